"""Data loading must never be the bottleneck: three figures for the user's-files path.

    python scripts/bench_data.py --small     # CI smoke (1 MB of text, 64 MB of tokens)
    python scripts/bench_data.py             # 20 MB of text, 2 GB of tokens (minutes on 2 cores)
    python scripts/bench_data.py --parts cold,ranks,line,many   # building the cache: 10-400 MB (~10 min quiet)

1. Tokenisation throughput: building looplib's token cache (read, hash, tokenise, write the
   memory-mapped file) against ``tokenizers``' own ``encode_batch`` (and ``encode_batch_fast``)
   on the same files with the same tokenizer, texts already read. Ratio = looplib MB/s over
   encode_batch MB/s (target >= 0.9).
2. ``data_wait_share`` (host time waiting for the loader / step time, from metrics.jsonl) of
   the default GPT (model=tiny) trained by the CLI on those files with loader workers.
3. Peak resident memory while training on a memory-mapped token cache of a few GB (written
   directly as random tokens: tokenising GBs of text would take an hour here) and then reading
   every window once, for the main process and its loader workers together.

Prints a markdown table. Inputs: the standard library's own source files (no download),
copied as .txt documents until the size is reached.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_texts(root: Path, total: int) -> list[Path]:
    """``*.py`` of the standard library copied as ``.txt`` documents until ``total`` bytes."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    root.mkdir(parents=True, exist_ok=True)
    files, size, i = [], 0, 0
    while size < total:
        src = sources[i % len(sources)]
        i += 1
        try:
            text = src.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        dst = root / f"{i:06d}.txt"
        dst.write_text(text, encoding="utf-8")
        files.append(dst)
        size += dst.stat().st_size
    return files


def tokenizer_file(files: list[Path], out: Path) -> Path:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator((f.read_text() for f in files[:400]), vocab_size=8192, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return out / "tokenizer.json"


def throughput(files: list[Path], tok_path: Path, work: Path, repeats: int) -> dict:
    from tokenizers import Tokenizer

    from looplib.data import TextCorpus

    tok = Tokenizer.from_file(str(tok_path))
    mb = sum(f.stat().st_size for f in files) / 1e6
    texts = [f.read_text(encoding="utf-8") for f in files]
    best = {"encode_batch": 1e9, "encode_batch_fast": 1e9, "looplib": 1e9}
    for r in range(repeats):  # a fresh tokenizer each time: its BPE word cache would favour a second call
        tok = Tokenizer.from_file(str(tok_path))
        t = time.perf_counter()
        tok.encode_batch(texts, add_special_tokens=False)
        best["encode_batch"] = min(best["encode_batch"], time.perf_counter() - t)
        tok = Tokenizer.from_file(str(tok_path))
        t = time.perf_counter()
        tok.encode_batch_fast(texts, add_special_tokens=False)
        best["encode_batch_fast"] = min(best["encode_batch_fast"], time.perf_counter() - t)
        shutil.rmtree(work / "cache", ignore_errors=True)
        os.environ["LOOPLIB_CACHE"] = str(work / "cache")  # cold: a new cache each time
        t = time.perf_counter()
        corpus = TextCorpus(str(files[0].parent), seq_len=128, tokenizer=str(tok_path), vocab_size=tok.get_vocab_size())
        best["looplib"] = min(best["looplib"], time.perf_counter() - t)
    del texts
    return {"mb": mb, **{k: mb / v for k, v in best.items()}, "tokens": corpus.train.n_tokens + corpus.eval.n_tokens}


def wait_share(files: list[Path], tok_path: Path, work: Path, steps: int, workers: int) -> dict:
    run = work / "run"
    env = {**os.environ, "LOOPLIB_CACHE": str(work / "cache"), "PYTHONWARNINGS": "ignore"}  # tokenised above
    cmd = [sys.executable, "-m", "looplib.train", "data=text", f"data.path={files[0].parent}",
           f"data.tokenizer={tok_path}", f"max_steps={steps}", "log_every=5", "eval_every=0", "eval_samples=4",
           "sample_tokens=0", "checkpoint.enabled=false", f"loader.num_workers={workers}",
           "loader.persistent_workers=true", f"hydra.run.dir={run}"]
    subprocess.run(cmd, check=True, env=env, capture_output=True, cwd=work)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    shares = [r["data_wait_share"] for r in rows if "data_wait_share" in r]
    tok_s = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return {"share": max(shares[1:] or shares), "mean": sum(shares[1:] or shares) / len(shares[1:] or shares),
            "tok_s": tok_s[-1] if tok_s else float("nan")}


RSS_SCRIPT = textwrap.dedent("""
    import json, os, re, sys, threading, time, numpy as np, torch
    from pathlib import Path
    from looplib import AdamW, TokenCrossEntropy, fit
    from looplib.data import TokenWindows, build_loader
    from looplib.data.cache import load
    from looplib.models import GPT

    def rss_mb(pid, field="Rss"):  # Pss: shared pages split between the processes sharing them
        try:
            rows = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            return next(int(r.split()[1]) for r in rows if r.startswith(field + ":")) / 1024
        except (OSError, StopIteration):
            return 0.0

    def token_pages(pid):  # resident pages of the token file's mapping in one process
        try:
            lines, total, inside = Path(f"/proc/{pid}/smaps").read_text().splitlines(), 0, False
        except OSError:
            return 0.0
        for line in lines:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header: address range ... path
                inside = line.endswith("tokens.bin")
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
        return total / 1024

    def tree():
        me = os.getpid()
        kids = Path(f"/proc/{me}/task/{me}/children").read_text().split()
        return (rss_mb(me), rss_mb(me, "Pss") + sum(rss_mb(k, "Pss") for k in kids),
                token_pages(me) + sum(token_pages(k) for k in kids))

    peak = {"main": 0.0, "all": 0.0, "file": 0.0}
    def watch():
        while True:
            for key, value in zip(("main", "all", "file"), tree()):
                peak[key] = max(peak[key], value)
            time.sleep(0.05)
    threading.Thread(target=watch, daemon=True).start()
    data = load(Path(sys.argv[1]))
    steps, workers = int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = GPT(vocab_size=8192, seq_len=128, n_layer=4, n_head=4, d_model=128)   # model=tiny
    AdamW(lr=1e-3).build(torch.nn.Linear(1, 1))  # torch.optim's imports, before the baseline
    time.sleep(0.1)
    before = dict(peak)
    train = TokenWindows(data, np.arange(1), 128)
    loader = build_loader(train, batch_size=32, seed=0, num_workers=workers)
    fit(model, loader, objective=TokenCrossEntropy(), optimizer=AdamW(lr=1e-3).build(model), max_steps=steps)
    after_training = dict(peak)
    sweep = build_loader(TokenWindows(data, np.arange(1), 1 << 16), batch_size=8, seed=0, shuffle=False,
                         num_workers=workers)
    t, seen = time.perf_counter(), 0
    for batch in sweep:
        seen += batch["input_ids"].numel()
    time.sleep(0.1)
    print(json.dumps({"before": before, "train": after_training, "sweep": dict(peak),
                      "read_s": time.perf_counter() - t, "seen": seen}))
""")


def peak_rss(work: Path, gb: float, steps: int, workers: int) -> dict:
    import numpy as np

    from looplib.data.cache import seal

    root = work / "big"
    root.mkdir()
    n = int(gb * 2**30) // 2
    tokens = np.memmap(root / "tokens.bin", dtype="<u2", mode="w+", shape=(n,))
    rng = np.random.default_rng(0)
    for i in range(0, n, 1 << 26):
        tokens[i:i + (1 << 26)] = rng.integers(0, 8192, min(1 << 26, n - i), dtype=np.uint16)
    tokens.flush()
    del tokens
    np.save(root / "offsets.npy", np.array([0, n], dtype=np.int64))
    seal(root, "<u2")  # meta.json with the checksums a cache carries (one without them is not opened)
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(root), str(steps), str(workers)], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"gb": n * 2 / 2**30, **result}


# ------------------------------------------------------------------ building the cache (issue: data at scale)
# The limit: the tokenizers library used directly on the same files, as looplib uses it: its BPE
# trained on the same text (at most looplib's TRAIN_BYTES of it), then encode_batch_fast (its
# threads, every core) into a memory-mapped file. looplib's figure is a whole command,
# `python -m looplib.train data=text ... max_steps=1`, from an empty cache: imports, the file
# scan, the tokenizer, the tokens, the model and one step.

def limit_s(files: list[Path], work: Path) -> float:
    import numpy as np
    from tokenizers import ByteLevelBPETokenizer

    from looplib.data.tokenizer import TRAIN_BYTES

    t = time.perf_counter()
    texts = [f.read_text(encoding="utf-8") for f in files]
    sample, seen = [], 0
    for text in texts:
        if seen >= TRAIN_BYTES:
            break
        sample.append(text)
        seen += len(text)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(sample, vocab_size=8192, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    out = np.memmap(work / "limit.bin", dtype="<u2", mode="w+", shape=(sum(len(t) for t in texts) + len(texts),))
    at = 0
    for i in range(0, len(texts), 256):  # batches of documents, ids appended as they come
        for enc in bpe._tokenizer.encode_batch_fast(texts[i:i + 256], add_special_tokens=False):
            ids = enc.ids
            out[at:at + len(ids)] = ids
            at += len(ids) + 1
    out.flush()
    took = time.perf_counter() - t
    del out
    (work / "limit.bin").unlink()
    return took


def train_cmd(path: Path, run: Path, extra=()) -> list[str]:
    return ["data=text", f"data.path={path}", "max_steps=1", "eval_every=0", "eval_samples=4", "sample_tokens=0",
            "checkpoint.enabled=false", "log_every=1", f"hydra.run.dir={run}", *extra]


def tree_pss_mb(pid: int) -> float:
    """PSS of ``pid`` and every descendant, MB (shared pages split between the processes sharing them)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            rows = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
            total += next(int(r.split()[1]) for r in rows if r.startswith("Pss:")) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(k) for k in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def timed(cmd: list[str], env: dict, cwd: Path) -> dict:
    """Wall time of ``cmd`` and its process tree's peak PSS, sampled every 50 ms from outside."""
    import threading

    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0.0]

    def watch():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_pss_mb(proc.pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, _ = proc.communicate()
    took = time.perf_counter() - t
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"bench_data: {' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}")
    return {"s": took, "peak_mb": peak[0], "out": out}


def looplib_run(path: Path, work: Path, name: str, cold: bool, ranks: int = 1, extra=()) -> dict:
    env = {**os.environ, "LOOPLIB_CACHE": str(work / f"cache-{name}"), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    if cold:
        shutil.rmtree(work / f"cache-{name}", ignore_errors=True)
    run = work / f"run-{name}-{time.monotonic_ns()}"
    if ranks == 1:
        cmd = [sys.executable, "-m", "looplib.train", *train_cmd(path, run, extra)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               "-m", "looplib.train", *train_cmd(path, run, extra)]
    result = timed(cmd, env, work)
    result["waited"] = result["out"].count("waiting for another process that is building")
    return result


def cold_start(work: Path, sizes_mb: list[float]) -> list[dict]:
    rows = []
    for mb in sizes_mb:
        texts = work / f"texts-{mb:g}"
        files = make_texts(texts, int(mb * 1e6))
        limit = limit_s(files, work)
        one = looplib_run(texts, work, f"c{mb:g}", cold=True)
        warm = looplib_run(texts, work, f"c{mb:g}", cold=False)
        rows.append({"mb": mb, "files": len(files), "limit_s": limit, "cold_s": one["s"], "warm_s": warm["s"],
                     "peak_mb": one["peak_mb"]})
    return rows


def two_ranks(work: Path, mb: float) -> dict:
    texts = work / f"texts-{mb:g}"
    if not texts.exists():
        make_texts(texts, int(mb * 1e6))
    one = looplib_run(texts, work, "r1", cold=True)
    two = looplib_run(texts, work, "r2", cold=True, ranks=2)
    return {"mb": mb, "one_s": one["s"], "two_s": two["s"], "waited": two["waited"], "peak_one": one["peak_mb"],
            "peak_two": two["peak_mb"]}


def long_line(work: Path, mb: float) -> dict:
    """One file of one line of ``mb`` MB (the standard library's text, newlines turned into spaces)."""
    root = work / f"line-{mb:g}"
    root.mkdir()
    with open(root / "line.txt", "w", encoding="utf-8") as f:
        size, sources = 0, sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
        for src in sources * 100:
            try:
                text = src.read_text(encoding="utf-8").replace("\n", " ")
            except (UnicodeDecodeError, OSError):
                continue
            f.write(text)
            size += len(text.encode())
            if size >= mb * 1e6:
                break
        f.write("\n")
    # one document: no held-out split of documents, a held-out file instead
    (root / "eval").mkdir()
    (root / "eval" / "held.txt").write_text("def held_out(x):\n    return x + 1\n" * 200)
    run = looplib_run(root / "line.txt", work, f"l{mb:g}", cold=True, extra=[f"data.eval_path={root / 'eval'}"])
    return {"mb": mb, "s": run["s"], "peak_mb": run["peak_mb"]}


def many_files(work: Path, n_small: int, n_big: int, each: int) -> dict:
    """A warm start over ``n_small`` files of ``each`` bytes, and over ``n_big`` files of the same bytes."""
    out = {}
    for name, n in (("small", n_small), ("big", n_big)):
        root = work / f"many-{name}"
        root.mkdir()
        total, size = n_small * each, n_small * each // n
        words = "the quick brown fox jumps over the lazy dog\n" * (size // 44 + 1)
        for i in range(n):
            (root / f"{i:07d}.txt").write_text((f"file {i}\n" + words)[:size])
        looplib_run(root, work, f"m{name}", cold=True)
        warm = [looplib_run(root, work, f"m{name}", cold=False)["s"] for _ in range(2)]
        out[name] = {"files": n, "bytes": total, "warm_s": min(warm)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CI smoke: a few MB, seconds")
    p.add_argument("--text-mb", type=float, default=None)
    p.add_argument("--tokens-gb", type=float, default=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--parts", default="throughput,wait,rss",
                   help="which figures (comma-separated): throughput, wait, rss; building the cache: cold "
                        "(cold and warm start against the limit), ranks (1 process against 2 under torchrun), "
                        "line (one long line), many (a warm start over many small files)")
    p.add_argument("--cold-mb", default=None, help="corpus sizes for cold, MB (default 10,100,400; --small 2)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    if parts & {"cold", "ranks", "line", "many"}:
        building(args, parts)
        if not parts & {"throughput", "wait", "rss"}:
            return
    text_mb = args.text_mb or (1 if args.small else 20)
    tokens_gb = args.tokens_gb or (0.0625 if args.small else 2.0)
    steps = 10 if args.small else 40
    work = Path(tempfile.mkdtemp(prefix="bench_data-"))
    try:
        files = make_texts(work / "texts", int(text_mb * 1e6)) if parts & {"throughput", "wait"} else []
        tok = tokenizer_file(files, work) if files else None
        tp = throughput(files, tok, work, repeats=2 if args.small else 3) if "throughput" in parts else None
        if "wait" in parts and tp is None:
            throughput(files, tok, work, repeats=1)  # the cache the CLI run reads
        ws = wait_share(files, tok, work, steps, args.workers) if "wait" in parts else None
        rss = peak_rss(work, tokens_gb, steps, args.workers) if "rss" in parts else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nbench_data ({os.cpu_count()} CPUs, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')})\n")
    print("| figure | value |\n|---|---|")
    if tp:
        print_throughput(tp, files)
    if ws:
        print(f"| data_wait_share, model=tiny, {args.workers} workers, {steps} steps (max / mean of logged rows) | "
              f"{ws['share']:.4f} / {ws['mean']:.4f} ({ws['tok_s']:.0f} tokens/s) |")
    if rss:
        print_rss(rss, steps)


def building(args, parts: set[str]) -> None:
    """The building figures, each a ratio against a baseline measured in the same run."""
    small = args.small
    sizes = [float(x) for x in (args.cold_mb or ("2" if small else "10,100,400")).split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_data-"))
    rows = {}
    try:
        if "cold" in parts:
            rows["cold"] = cold_start(work, sizes)
        if "ranks" in parts:
            rows["ranks"] = two_ranks(work, 2 if small else 100)
        if "line" in parts:
            rows["line"] = long_line(work, 2 if small else 100)
        if "many" in parts:
            rows["many"] = many_files(work, 2000 if small else 200_000, 30 if small else 300, 500)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nbench_data: building the token cache ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end)\n")
    print("| figure | looplib | baseline | ratio | goal |\n|---|---|---|---|---|")
    for r in rows.get("cold", []):
        print(f"| cold start, {r['mb']:g} MB in {r['files']} files (whole command; baseline: tokenizers' BPE + "
              f"encode_batch_fast into a memmap) | {r['cold_s']:.1f} s | {r['limit_s']:.1f} s | "
              f"{r['cold_s'] / r['limit_s']:.2f}x | 1.1x at 100 MB and more |")
        print(f"| warm start, {r['mb']:g} MB | {r['warm_s']:.1f} s | | | |")
        print(f"| peak memory of the cold start's process tree (PSS, sampled), {r['mb']:g} MB | "
              f"{r['peak_mb']:.0f} MB | | | under 1 GB at 400 MB |")
    if "ranks" in rows:
        r = rows["ranks"]
        print(f"| cold start, {r['mb']:g} MB, 2 processes under torchrun (baseline: 1 process) | {r['two_s']:.1f} s | "
              f"{r['one_s']:.1f} s | {r['two_s'] / r['one_s']:.2f}x | 1.1x |")
        print(f"| ranks that waited for the other's build | {r['waited']} of 2 | | | 1 |")
    if "line" in rows:
        r = rows["line"]
        print(f"| peak memory, one line of {r['mb']:g} MB, cold (PSS of the tree, sampled) | {r['peak_mb']:.0f} MB "
              f"| | | under 1 GB |")
        print(f"| its cold start | {r['s']:.1f} s | | | |")
    if "many" in rows:
        m = rows["many"]
        print(f"| warm start, {m['small']['files']:,} files of {m['small']['bytes'] // m['small']['files']} bytes "
              f"(baseline: the same bytes in {m['big']['files']} files) | {m['small']['warm_s']:.1f} s | "
              f"{m['big']['warm_s']:.1f} s | {m['small']['warm_s'] / m['big']['warm_s']:.2f}x | 2x |")


def print_throughput(tp, files):
    print(f"| text tokenised | {tp['mb']:.1f} MB in {len(files)} files, {tp['tokens'] / 1e6:.1f} M tokens |")
    print(f"| tokenizers encode_batch | {tp['encode_batch']:.2f} MB/s |")
    print(f"| tokenizers encode_batch_fast | {tp['encode_batch_fast']:.2f} MB/s |")
    print(f"| looplib token cache (read, hash, tokenise, write) | {tp['looplib']:.2f} MB/s |")
    print(f"| ratio looplib / encode_batch | {tp['looplib'] / tp['encode_batch']:.2f} |")
    print(f"| ratio looplib / encode_batch_fast | {tp['looplib'] / tp['encode_batch_fast']:.2f} |")


def print_rss(rss, steps):
    print(f"| memory-mapped corpus | {rss['gb']:.2f} GB of tokens |")
    for name, what in (("before", "before any data (imports, model)"), ("train", f"training {steps} steps"),
                       ("sweep", "then reading every window once")):
        print(f"| peak memory {what}: main RSS / main + workers PSS / mapped file pages, all | "
              f"{rss[name]['main']:.0f} / {rss[name]['all']:.0f} / {rss[name]['file']:.0f} MB |")
    print(f"| read | {rss['seen'] * 2 / 2**30:.2f} GB in {rss['read_s']:.1f} s |")


if __name__ == "__main__":
    main()

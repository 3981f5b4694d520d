"""Data at the scale users bring: refusals before the tokenizer trains, memory and time that do not
grow with the length of a line, one build per cache entry, tokens brought ready-made."""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from looplib.data import TextCorpus
from looplib.data.readers import CHUNK_BYTES, text_pieces
from looplib.errors import ConfigError

from conftest import REPO
import warm_ranks


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPLIB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def built(cache_dir) -> list[str]:
    """The cache's entries (tokenizers, token caches), not its index of file digests or its locks."""
    return sorted(p.name for p in cache_dir.iterdir() if p.name not in ("index", "locks")) if cache_dir.exists() else []


def test_one_document_is_refused_before_a_tokenizer_trains(tmp_path, cache_dir, monkeypatch):
    """One plain-text file with the default held-out fraction: the document count is known from
    the file list, so the refusal comes before any training and the cache holds nothing."""
    import tokenizers

    trained = []
    real = tokenizers.ByteLevelBPETokenizer.train_from_iterator
    monkeypatch.setattr(tokenizers.ByteLevelBPETokenizer, "train_from_iterator",
                        lambda *a, **k: trained.append(1) or real(*a, **k))
    (tmp_path / "one.txt").write_text("the model learns the loop. " * 200)
    with pytest.raises(ConfigError) as err:
        TextCorpus(str(tmp_path / "one.txt"), seq_len=8, vocab_size=300)
    assert str(err.value).startswith("data.eval_fraction: ") and "holds 1 document(s)" in str(err.value)
    assert trained == [] and built(cache_dir) == []
    (tmp_path / "rows.jsonl").write_text('{"text": "a b c"}\n\n{"text": "d e f"}\n')
    with pytest.raises(ConfigError, match="holds 2 document"):  # at most one per line that is not blank
        TextCorpus(str(tmp_path / "rows.jsonl"), seq_len=8, vocab_size=300, eval_fraction=0.9)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ConfigError, match="holds no text"):
        TextCorpus(str(tmp_path / "empty"), seq_len=8, vocab_size=300)
    assert trained == [] and built(cache_dir) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_one_line_before_any_work(tmp_path, cache_dir):
    root = tmp_path / "texts"
    root.mkdir()
    for i in range(3):
        (root / f"d{i}.txt").write_text("the model learns " * 20)
    (root / "d1.txt").chmod(0)
    with pytest.raises(ConfigError) as err:
        TextCorpus(str(root), seq_len=8, vocab_size=300)
    assert str(err.value).startswith(f"data.path: {root / 'd1.txt'} cannot be read") and "\n" not in str(err.value)
    assert built(cache_dir) == []


def test_a_refusal_after_training_leaves_no_tokenizer(tmp_path, cache_dir):
    """Too few tokens for one window is known only after tokenising: the tokenizer this run
    trained goes with the refusal."""
    root = tmp_path / "texts"
    root.mkdir()
    for i in range(3):
        (root / f"d{i}.txt").write_text("the model learns")
    with pytest.raises(ConfigError, match="too few for one window"):
        TextCorpus(str(root), seq_len=4096, vocab_size=300, eval_fraction=0)
    assert not [p for p in cache_dir.iterdir() if p.name.startswith("tokenizer-")]


def test_long_lines_are_cut_at_whitespace_or_a_character_boundary(tmp_path):
    words = ("naïve café → " * (CHUNK_BYTES // 8)).encode()  # no newline; multi-byte characters
    solid = ("é" * (CHUNK_BYTES // 2 + 7) + "→" * 1000).encode()  # no whitespace either
    for name, data in (("words", words), ("solid", solid)):
        (tmp_path / name).write_bytes(data)
        pieces = list(text_pieces(tmp_path / name))
        assert "".join(pieces).encode() == data and len(pieces) > 1, name
        assert max(len(p.encode()) for p in pieces) <= CHUNK_BYTES, name
        if name == "words":  # before a space: a byte-level BPE keeps " word" whole
            assert all(p.startswith(" ") for p in pieces[1:])


PEAK = textwrap.dedent("""
    import os, sys, threading, time
    def tree_rss(root):
        kids = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                kids.setdefault(int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]), []).append(int(pid))
            except (OSError, IndexError, ValueError):
                pass
        total, todo = 0, [root]
        while todo:
            pid = todo.pop()
            todo += kids.get(pid, [])
            try:
                total += int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass
        return total
    """)


def run_with_peak(script: str, timeout: int) -> tuple[subprocess.CompletedProcess | None, int]:
    """``script`` in a fresh interpreter (killed after ``timeout`` s: None), and the peak resident
    memory of its whole process tree (sampled from /proc: ``ru_maxrss`` misses children and
    threads' transient peaks between samples less often than one would hope)."""
    ns = {}
    exec(PEAK, ns)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "2"})
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], ns["tree_rss"](proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, peak[0]
    finally:
        done.set()
        sampler.join()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), peak[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pathological_lines_train_in_bounded_time_and_memory(tmp_path):
    """A 4 MB line of one repeated character (its tokenizer's training hung for minutes) and a
    6 MB line of words (one piece of 6 MB: hundreds of MB per MB of line) build a corpus within
    the timeout and a bounded peak over the whole process tree."""
    (tmp_path / "same.txt").write_bytes(b"a" * (4 << 20))
    (tmp_path / "words.txt").write_bytes(b" ".join(b"w%d" % (i % 5000) for i in range(6 << 18)))
    (tmp_path / "short.txt").write_text("the model learns\n")
    script = textwrap.dedent(f"""
        import os
        os.environ["LOOPLIB_CACHE"] = {str(tmp_path / "cache")!r}
        from looplib.data import TextCorpus
        c = TextCorpus({str(tmp_path)!r}, seq_len=64, vocab_size=512, eval_fraction=0.3)
        print(len(c.train), c.train.n_tokens + c.eval.n_tokens)
    """)
    done, peak = run_with_peak(script, timeout=150)
    assert done is not None, "building the corpus did not finish in 150 s"
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) > 0
    print("peak MB", peak >> 20)
    assert peak < 1000 << 20, f"peak {peak >> 20} MB over the process tree for 10 MB of text"


BUILD_ONCE = textwrap.dedent("""
    import logging, os, sys, time, zlib
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    from looplib.data import TextCorpus
    rank, here = os.environ["RANK"], Path(sys.argv[1])
    (here / f"ready{rank}").touch()
    while not all((here / f"ready{r}").exists() for r in "01"):  # both ranks start building together
        time.sleep(0.01)
    c = TextCorpus(str(here / "texts"), seq_len=32, vocab_size=400)
    data = c.train.tokens.read(0, len(c.train.tokens))
    print(f"rank {rank} tokens {len(data)} crc {zlib.crc32(data.tobytes())} at {c.train.tokens.path}", flush=True)
    """)


def test_a_cold_cache_is_built_once_under_torchrun(tmp_path):
    """Two ranks asking for the same cold cache at once: one trains the tokenizer and tokenises
    (holding the entry's lock); the other waits and opens the same files."""
    import random
    from looplib.process.launcher import free_port

    rng = random.Random(0)
    (tmp_path / "texts").mkdir()
    for i in range(40):
        words = [f"w{rng.randrange(3000)}" for _ in range(3000)]
        (tmp_path / "texts" / f"d{i}.txt").write_text(" ".join(words))
    (tmp_path / "build.py").write_text(BUILD_ONCE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOOPLIB_CACHE": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(warm_ranks.command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "--tee", "3", str(tmp_path / "build.py"), str(tmp_path)]),
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    import re
    assert len(re.findall(r"^\[default\d\]:training a (400-token )?byte-level BPE", out, re.M)) == 1, out
    assert len(re.findall(r"^\[default\d\]:building the token cache", out, re.M)) == 1, out
    said = re.findall(r"rank (\d) tokens (\d+) crc (\d+) at (\S+)", out)
    assert sorted(s[0] for s in said) == ["0", "1"] and len({s[1:] for s in said}) == 1, out


def test_a_warm_start_reads_only_the_files_that_changed(tmp_path, monkeypatch):
    """The index of sizes and times: a second start hashes nothing, an edit is hashed again, and an
    edit that keeps the size and sets the mtime back is still seen (its ctime moved)."""
    from looplib.data import index

    monkeypatch.setattr(index, "RACY_NS", 0)  # (the files were written just now)
    hashed = []
    real = index.hash_file
    monkeypatch.setattr(index, "hash_file", lambda f, *a: hashed.append(f.name) or real(f, *a))
    root = tmp_path / "texts"
    root.mkdir()
    for i in range(30):
        (root / f"d{i:02d}.txt").write_text(f"the model learns the loop {i} " * 20)
    make = lambda: TextCorpus(str(root), seq_len=8, vocab_size=300).identity["train"]  # noqa: E731
    first = make()
    assert len(hashed) == 30
    hashed.clear()
    assert make() == first and hashed == []  # warm: nothing read
    (root / "d03.txt").write_text("an edit of another size " * 20)
    assert make()["files"] != first["files"] and hashed == ["d03.txt"]
    hashed.clear()
    f, before = root / "d07.txt", (root / "d07.txt").stat()
    time.sleep(0.05)
    f.write_text(f.read_text().replace("model", "MODEL"))  # same size
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime set back
    assert f.stat().st_size == before.st_size and f.stat().st_mtime_ns == before.st_mtime_ns
    now = make()
    assert hashed == ["d07.txt"] and now["files"][str(f)] != first["files"][str(f)]


def word_level(tmp_path, words: list[str]):
    """A word-level tokenizer (one id per word, whitespace between words), with an end-of-text token."""
    import json
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<|endoftext|>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return tok, tmp_path / "tok" / "tokenizer.json"


def test_tokens_brought_ready_made_are_the_batches_text_would_give(tmp_path):
    """The same documents as text (through a word-level tokenizer) and as ids, in nanoGPT's raw
    uint16 file and in llm.c's headered shards (uint16 and uint32, two shards): the same windows,
    bit for bit, the same held-out split, and the same ids as were written."""
    import random
    import numpy as np
    import torch
    from looplib.data import TokenCorpus

    rng = random.Random(0)
    words = [f"w{i}" for i in range(500)]
    tok, tok_file = word_level(tmp_path, words)
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(40)]
    (tmp_path / "texts").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "texts" / f"d{i:02d}.txt").write_text(d)
    eos = tok.token_to_id("<|endoftext|>")
    ids = np.array([i for d in docs for i in tok.encode(d).ids + [eos]], dtype="<u2")
    (tmp_path / "raw.bin").write_bytes(ids.tobytes())
    half = int(np.flatnonzero(ids == eos)[19]) + 1   # two shards, cut after a document
    for version, kind in ((1, "<u2"), (2, "<u4")):
        for n, part in enumerate((ids[:half], ids[half:])):
            header = np.zeros(256, "<i4")
            header[:3] = 20240520, version, len(part)
            (tmp_path / f"v{version}_{n}.bin").write_bytes(header.tobytes() + part.astype(kind).tobytes())
    common = dict(seq_len=16, eval_fraction=0.2, seed=5)
    text = TextCorpus(str(tmp_path / "texts"), tokenizer=str(tok_file), vocab_size=tok.get_vocab_size(), **common)
    for name in ("raw.bin", "v1_*.bin", "v2_*.bin"):
        got = TokenCorpus(str(tmp_path / name), vocab_size=tok.get_vocab_size(), eos_id=eos, **common)
        assert got.train.tokens.read(0, len(ids)).tolist() == ids.tolist(), name
        assert np.array_equal(got.eval_docs, text.eval_docs) and len(got.train) == len(text.train) > 0, name
        for split in ("train", "eval"):
            a, b = getattr(text, split), getattr(got, split)
            assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and torch.equal(a[i]["labels"], b[i]["labels"])
                       for i in range(len(a))), (name, split)


def test_tokens_refusals(tmp_path):
    import numpy as np
    from looplib.data import TokenCorpus

    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.array([1, 2, 70000], "<u4").tofile(tmp_path / "wide.bin")
    header = np.zeros(256, "<i4")
    header[:3] = 20240520, 1, 100
    (tmp_path / "short.bin").write_bytes(header.tobytes() + np.arange(50, dtype="<u2").tobytes())
    (tmp_path / "one.bin").write_bytes(np.array([5, 6, 7, 9, 5, 6], "<u2").tobytes())
    cases = {
        "odd.bin": (dict(), "data.path: " + str(tmp_path / "odd.bin") + " holds 3 bytes, not a whole number"),
        "wide.bin": (dict(dtype="uint32", vocab_size=1000, eos_id=None), "data.vocab_size: " + str(tmp_path / "wide.bin")
                     + " holds id 70000 (at position 2), outside a vocabulary of data.vocab_size=1000"),
        "short.bin": (dict(), "header says 100 ids of 2 bytes, but it holds 100 bytes after the header"),
        "one.bin": (dict(vocab_size=10, eos_id=9, eval_fraction=0.9), "data.eval_fraction: " + str(tmp_path / "one.bin") + " holds 2 document"),
    }
    for name, (kw, message) in cases.items():
        with pytest.raises(ConfigError) as err:
            TokenCorpus(str(tmp_path / name), seq_len=2, **kw)
        assert message in str(err.value) and "\n" not in str(err.value), (name, str(err.value))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal")
def test_progress_on_a_terminal_and_as_lines_elsewhere(tmp_path):
    """A pseudo-terminal that reports no size (as under `script` or many CI runners) shows the
    bars with bytes and rate; a log file gets plain lines."""
    import pty
    import random

    rng = random.Random(0)
    (tmp_path / "t").mkdir()
    for i in range(3):
        (tmp_path / "t" / f"d{i}.txt").write_text(" ".join(f"w{rng.randrange(4000)}" for _ in range(20000)))
    script = textwrap.dedent(f"""
        import logging, sys
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
        import looplib.data.progress as c
        c.PROGRESS_BYTES, c.LINE_EVERY_S = 1 << 10, 0
        from looplib.data import TextCorpus
        TextCorpus({str(tmp_path / "t")!r}, seq_len=32, vocab_size=300)
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for where, (caches, out) in {"terminal": ("a", None), "log": ("b", subprocess.PIPE)}.items():
        env["LOOPLIB_CACHE"] = str(tmp_path / caches)
        if out is None:
            master, slave = pty.openpty()
            proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=slave, env=env)
            os.close(slave)
            chunks = []
            while True:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            assert proc.wait(timeout=120) == 0
            os.close(master)
            said = b"".join(chunks).decode(errors="replace")
            assert "reading text for the tokenizer" in said and "tokenising t:" in said and "B/s" in said, said[-2000:]
        else:
            r = subprocess.run([sys.executable, "-c", script], stdout=out, stderr=subprocess.PIPE, env=env, text=True,
                               timeout=120)
            assert r.returncode == 0, r.stderr
            assert "tokenising t: " in r.stdout and "MB/s, about" in r.stdout and "\r" not in r.stderr, r.stdout


def test_a_refusal_while_the_data_is_built_reaches_the_waiting_rank(tmp_path):
    """Under torchrun, a refusal that only the tokens decide (too few for one window) is found by
    the rank that builds; the other, waiting for its lock, stops because that rank refused."""
    import re
    from looplib.process.launcher import free_port

    (tmp_path / "texts").mkdir()
    for i in range(3):
        (tmp_path / "texts" / f"d{i}.txt").write_text("the model learns the loop " * 3)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOOPLIB_CACHE": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore",
           "LOOPLIB_EXIT_FILE": str(tmp_path / "status")}
    r = subprocess.run(warm_ranks.command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "--tee", "3", "-m", "looplib.train", "data=text",
                        f"data.path={tmp_path / 'texts'}", "data.vocab_size=300", "data.eval_fraction=0",
                        "model.seq_len=512", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "max_steps=2",
                        f"hydra.run.dir={tmp_path / 'run'}"]), cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    said = re.findall(r"^\[default(\d)\]:(looplib: .*)$", out, re.M)
    assert r.returncode != 0 and (tmp_path / "status").read_text().strip() == "2", out
    errors = [(rank, line) for rank, line in said if line.startswith("looplib: error: data.path: the training split")]
    assert len(errors) == 1, out  # said once, by the rank that built
    others = [line for rank, line in said if rank != errors[0][0]]
    assert others and all("refused the job" in line or line == errors[0][1] for line in others), out
    assert "Traceback" not in "\n".join(re.findall(r"^\[default\d\]:.*$", out, re.M)), out  # (torchrun's own has one)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("tokenizer-")]


def test_a_saved_datasets_directory_reads_as_the_same_text_and_ids(tmp_path):
    """A Hugging Face ``datasets`` directory written by ``save_to_disk`` (two Arrow files): its
    ``text`` column through data=text gives the batches the same records give as JSON Lines, and its
    ``input_ids`` column through data=tokens the batches the same ids give as a raw .bin, bit for
    bit; a saved DatasetDict and a missing column are refused in one line."""
    datasets = pytest.importorskip("datasets")
    import random
    import numpy as np
    import torch
    from looplib.data import TokenCorpus

    rng = random.Random(1)
    words = [f"w{i}" for i in range(300)]
    tok, tok_file = word_level(tmp_path, words)
    eos = tok.token_to_id("<|endoftext|>")
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 50))) for _ in range(30)]
    ids = [tok.encode(d).ids + [eos] for d in docs]
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": docs, "input_ids": ids}).save_to_disk(str(saved), num_shards=2)
    assert len(list(saved.glob("*.arrow"))) == 2
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    np.array([i for doc in ids for i in doc], "<u2").tofile(tmp_path / "raw.bin")
    common = dict(seq_len=16, eval_fraction=0.2, seed=3)
    pairs = [(TextCorpus(str(tmp_path / "docs.jsonl"), tokenizer=str(tok_file), vocab_size=tok.get_vocab_size(), **common),
              TextCorpus(str(saved), tokenizer=str(tok_file), vocab_size=tok.get_vocab_size(), **common)),
             (TokenCorpus(str(tmp_path / "raw.bin"), vocab_size=tok.get_vocab_size(), eos_id=eos, **common),
              TokenCorpus(str(saved), vocab_size=tok.get_vocab_size(), eos_id=eos, **common))]
    for want, got in pairs:
        assert np.array_equal(want.eval_docs, got.eval_docs) and len(want.train) == len(got.train) > 0
        for split in ("train", "eval"):
            a, b = getattr(want, split), getattr(got, split)
            assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(len(a))), (type(got), split)
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:20]}),
                                   "test": datasets.Dataset.from_dict({"text": docs[20:]})})
    splits.save_to_disk(str(tmp_path / "dict"))
    cases = [(lambda: TextCorpus(str(tmp_path / "dict"), tokenizer=str(tok_file), **common),
              "is a saved DatasetDict of several splits (train, test), not one dataset; give one split's folder: "
              f"data.path={tmp_path / 'dict' / 'train'}"),
             (lambda: TokenCorpus(str(saved), vocab_size=tok.get_vocab_size(), eos_id=eos, column="ids", **common),
              "has no column 'ids' (columns: text, input_ids)")]
    for make, message in cases:
        with pytest.raises(ConfigError) as err:
            make()
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)

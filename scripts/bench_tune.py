"""Does looplib.tune's prediction hold, and is its command never slower than the job as given?

    python scripts/bench_tune.py --out results/cpu-2026-11-26-tune
    python scripts/bench_tune.py --jobs lora --repeats 3 --out /tmp/bench      # one job
    python scripts/bench_tune.py --jobs default --tune-args tune.budget_s=900

On three jobs (the default job; a LoRA fine-tune of a tiny transformers Llama on chat records,
padded per batch; a classification job of bert_tiny on text records, padded per batch), all made
on this machine with no download: run ``python -m looplib.tune`` on the job, then run the job as
given and tune's command end to end, ``--repeats`` times each, interleaved (A B, B A, A B, ...:
a drift of the machine hits both), timing each process from its start to its exit.

For each: tune's predicted seconds (the geometric mean of its runs' predictions, with a 95%
t-interval on their logarithms) against the measured ones (likewise), their ratio measured /
predicted with Welch's 95% interval (``looplib.tune.stats``: "agree" when it holds 1), and tune's
command against the job as given, measured (its ratio and interval: "never slower" when the
interval's low end is at most 1). The 1-minute load average is recorded before every run: the
machine is shared. Written to --out: tune_bench.md and tune_bench.json (a job run again replaces
its own results there; the other jobs' stay).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from looplib.tune import stats

WORDS = ("the a model learns data file token window train loop python code value list index and of to is in "
         "with for this that from by on it as be are was not or at can will one all its which would their").split()


def chat_records(path: Path, n: int = 400, seed: int = 0) -> Path:
    """Chat records ({"messages": [user, assistant]}) of varied lengths: padded batches change shape."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ask = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30)))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
            f.write(json.dumps({"messages": [{"role": "user", "content": ask},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def class_records(path: Path, n: int = 600, seed: int = 1) -> Path:
    """Text records with a label (1 when "python" occurs more than "code"), of varied lengths."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 80))]
            f.write(json.dumps({"text": " ".join(words), "label": int(words.count("python") > words.count("code"))})
                    + "\n")
    return path


def jobs(work: Path) -> dict[str, list[str]]:
    """The three jobs' overrides (the data and the tiny model made on first use)."""
    model = work / "tiny-llama"
    if not (model / "config.json").exists():
        from looplib.make_tiny_model import make_tiny_model
        make_tiny_model(model)  # a 2-layer Llama, hidden 64, a 1,024-token BPE trained on local text
    chat = chat_records(work / "chat.jsonl")
    records = class_records(work / "records.jsonl")
    return {
        "default": [],
        "lora": ["model=hf", f"model.path={model}", "data=instruct", f"data.path={chat}", "+peft=lora",
                 "max_steps=60", "batch_size=8", "eval_every=20", "eval_samples=4"],
        "classify": ["model=bert_tiny", "data=classification", f"data.path={records}", f"data.tokenizer={model}",
                     "loss=classification", "max_steps=100", "batch_size=16", "sample_tokens=0"],
    }


def run(argv: list[str], log: Path, env: dict) -> dict:
    """One process, timed from its start to its exit, with the load average before it."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    return {"seconds": round(time.perf_counter() - t0, 2), "status": code, "load": round(load, 2)}


def interval(times: list[float]) -> tuple[float, float | None, float | None]:
    """The geometric mean of ``times`` and its 95% t-interval (on the logarithms)."""
    logs = [math.log(t) for t in times]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None, None
    half = stats.t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def text(value: tuple) -> str:
    mean, low, high = value
    return f"{mean:,.1f}" + (f" [{low:,.1f}-{high:,.1f}]" if low is not None else " (one run)")


def bench_job(name: str, job: list[str], work: Path, repeats: int, tune_args: list[str], env: dict) -> dict:
    where = work / name
    where.mkdir(parents=True, exist_ok=True)
    print(f"[bench] {name}: tune", flush=True)
    tuned = run([sys.executable, "-m", "looplib.tune", *job, *tune_args, "tune.fresh=true",
                 f"hydra.run.dir={where / 'tune'}"], where / "tune.log", env)
    result = json.loads((where / "tune" / "tune.json").read_text())
    best = result["best"]
    rows = {r["candidate"]: r for r in result["rows"]}
    given_row, best_row = rows.get("as given"), rows[best["candidate"]]
    chosen = shlex.split(best["command"])[3:]  # python -m looplib.train ...
    commands = {"as given": job, "tune's command": chosen}
    measured: dict[str, list[dict]] = {k: [] for k in commands}
    for i in range(repeats):  # interleaved: A B, B A, A B ...
        order = list(commands) if i % 2 == 0 else list(commands)[::-1]
        for which in order:
            tag = "given" if which == "as given" else "tuned"
            print(f"[bench] {name}: {which}, run {i + 1}", flush=True)
            measured[which].append(run([sys.executable, "-m", "looplib.train", *commands[which],
                                        f"hydra.run.dir={where / f'{tag}{i}'}"], where / f"{tag}{i}.log", env))
    out = {"job": name, "overrides": job, "tune_seconds": tuned["seconds"], "tune_status": tuned["status"],
           "tune_load": result.get("load"), "choice": best["candidate"], "why": (result.get("decision") or {}).get("why"),
           "command": best["command"], "rows": {}}
    for which, row in (("as given", given_row), ("tune's command", best_row)):
        if row is None or not row.get("job_s_runs"):
            continue
        seconds = [m["seconds"] for m in measured[which] if m["status"] == 0]
        predicted, actual = interval(row["job_s_runs"]), interval(seconds)
        agreement = stats.ratio(seconds, row["job_s_runs"])
        out["rows"][which] = {"candidate": row["candidate"], "predicted_runs": row["job_s_runs"],
                              "predicted": predicted, "measured_runs": measured[which], "measured": actual,
                              "measured_over_predicted": agreement.to_dict(),
                              "agree": agreement.low is not None and agreement.low <= 1 <= agreement.high}
    given = [m["seconds"] for m in measured["as given"] if m["status"] == 0]
    tuned_s = [m["seconds"] for m in measured["tune's command"] if m["status"] == 0]
    versus = stats.ratio(tuned_s, given)
    out["tuned_over_given"] = versus.to_dict()
    out["never_slower"] = versus.low is None or versus.low <= 1
    return out


def markdown(results: list[dict], started: str) -> str:
    lines = ["# looplib.tune: predicted against measured", "",
             f"Machine: {os.cpu_count()} cores, shared with other work while it ran (1-minute load average "
             "before each run in the json). Seconds from each process's start to its exit; intervals are 95% "
             "(t on the logarithms of the runs; the ratio: Welch's).", "",
             "| job | what ran | tune's choice | predicted s | measured s | measured / predicted | agree | "
             "load (min-max) |", "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for which, row in res["rows"].items():
            ratio = row["measured_over_predicted"]
            loads = [m["load"] for m in row["measured_runs"]]
            lines.append(f"| {res['job']} | {which} (`{row['candidate']}`) | {res['choice']} | "
                         f"{text(row['predicted'])} ({len(row['predicted_runs'])} runs) | "
                         f"{text(row['measured'])} ({len(row['measured_runs'])} runs) | "
                         f"{ratio['ratio']:.2f}x" + (f" [{ratio['low']:.2f}-{ratio['high']:.2f}]" if ratio["low"] else "")
                         + f" | {'yes' if row['agree'] else 'no'} | {min(loads):.1f}-{max(loads):.1f} |")
    lines += ["", "| job | tune's command / the job as given (measured) | never slower | tune took s | "
              "tune's load |", "|---|---|---|---|---|"]
    for res in results:
        v = res["tuned_over_given"]
        load = res.get("tune_load") or {}
        lines.append(f"| {res['job']} | {v['ratio']:.2f}x" + (f" [{v['low']:.2f}-{v['high']:.2f}]" if v["low"] else "")
                     + f" | {'yes' if res['never_slower'] else 'no'} | {res['tune_seconds']:,.0f} | "
                     f"{load.get('min', '-')}-{load.get('max', '-')} |")
    lines += ["", "The jobs:", ""] + [f"- {r['job']} ({r.get('date', started)}): `python -m looplib.train "
                                      f"{' '.join(r['overrides'])}`; tune chose {r['choice']}: {r['why']}"
                                      for r in results]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/tune_bench")
    parser.add_argument("--work", default=None, help="where the runs go (default: OUT/work)")
    parser.add_argument("--jobs", default="default,lora,classify")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tune-args", nargs="*", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    started = time.strftime("%Y-%m-%d %H:%M")
    every = jobs(work)
    saved = out / "tune_bench.json"
    results = json.loads(saved.read_text()) if saved.exists() else []  # other jobs' results stay
    for name in args.jobs.split(","):
        done = bench_job(name, every[name], work, args.repeats, args.tune_args, env)
        done["date"] = time.strftime("%Y-%m-%d %H:%M")
        results = [r for r in results if r["job"] != name] + [done]
        results.sort(key=lambda r: list(every).index(r["job"]))
        saved.write_text(json.dumps(results, indent=1) + "\n")
        (out / "tune_bench.md").write_text(markdown(results, started))
    print((out / "tune_bench.md").read_text())


if __name__ == "__main__":
    main()

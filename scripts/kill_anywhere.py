"""Kill a training run with SIGKILL at random moments, resume it, and check the final weights.

    python scripts/kill_anywhere.py --trials 100 --parallel 2
    python scripts/kill_anywhere.py --trials 20 --async     # checkpoints written in the background

Each trial starts `python -m looplib.train` with a checkpoint after every optimizer step (so
many kills land inside a checkpoint write), kills it at a random moment, then resumes it
with `resume=auto` until it finishes; the final weights must equal those of a run that was
never interrupted. tests/cli/test_resume_cli.py runs 8 trials in CI. With ``--async`` the interrupted
runs write their checkpoints in the background (``checkpoint.async=true``; the reference does not).
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ARGS = ["data=random", "data.n_train=128", "model.seq_len=32", "model.n_layer=4", "model.d_model=128",
        "batch_size=4", "accum_steps=2", "max_steps=16", "checkpoint.every_steps=1", "checkpoint.keep=2",
        "log_every=1", "eval_every=0", "eval_samples=4", "sample_tokens=0", "progress=lines"]


def train(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "looplib.train", *ARGS, *extra, f"hydra.run.dir={run_dir}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(run_dir / "model.safetensors"))


def reference(root: Path) -> dict:
    run_dir = root / "reference"
    proc = train(run_dir)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the reference run failed: {err}")
    return final_weights(run_dir)


def trial(root: Path, seed: int, expected: dict, extra: tuple[str, ...] = ()) -> tuple[bool, str]:
    """One kill at a random moment of the training phase, then resume until done."""
    import torch

    rng = random.Random(seed)
    run_dir = root / f"trial-{seed}"
    proc = train(run_dir, "resume=auto", *extra)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while not metrics.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)  # wait for training to start: killing during imports proves nothing
    time.sleep(rng.uniform(0.0, 1.2))
    killed_at = "after it finished" if proc.poll() is not None else "while running"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    for _ in range(3):  # resume (a resumed run is not killed again)
        proc = train(run_dir, "resume=auto", *extra)
        _, err = proc.communicate()
        if proc.returncode == 0:
            break
    else:
        return False, f"trial {seed}: resume failed: {err.strip().splitlines()[-1:]}"
    got = final_weights(run_dir)
    same = got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    return same, f"trial {seed}: killed {killed_at} after ~{steps_done} logged steps: " + (
        "same final weights" if same else "DIFFERENT final weights")


def run_trials(n: int, parallel: int = 2, root: Path | None = None, seed: int = 0,
               expected: dict | None = None, extra: tuple[str, ...] = ()) -> list[tuple[bool, str]]:
    """``n`` trials, ``parallel`` at a time; ``expected``: the uninterrupted run's final weights
    (trained here when not given); ``extra``: overrides of the interrupted runs only."""
    root = Path(root or tempfile.mkdtemp(prefix="kill-anywhere-"))
    expected = expected if expected is not None else reference(root)
    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda i: trial(root, seed + i, expected, extra), range(n)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async", dest="background", action="store_true",
                        help="the interrupted runs write their checkpoints in the background (checkpoint.async=true)")
    args = parser.parse_args()
    results = run_trials(args.trials, args.parallel, seed=args.seed,
                         extra=("checkpoint.async=true",) if args.background else ())
    for _, line in results:
        print(line)
    passed = sum(ok for ok, _ in results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

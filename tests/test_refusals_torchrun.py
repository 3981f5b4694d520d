"""A refusal always arrives under torchrun (issue 34): whichever rank refuses says its line (identical
lines from several ranks said once), the others say they stopped because that rank refused (not a
preemption), and ``LOOPLIB_EXIT_FILE`` holds 2, never 75."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import has_bitsandbytes
from looplib.engines.launch import free_port

TESTS = Path(__file__).resolve().parent
JOB = ["data=random", "data.n_train=64", "data.n_eval=8", "max_steps=3", "log_every=1", "eval_every=0",
       "eval_samples=4", "sample_tokens=0", "batch_size=4", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
       "model.seq_len=16", "progress=lines"]


def torchrun(tmp_path: Path, *overrides: str) -> tuple[dict[int, list[str]], str, str]:
    """Each rank's looplib lines (``--tee``: every line prefixed with its rank), the whole
    output, and what the exit file holds."""
    status = tmp_path / "status"
    status.write_text("stale\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "LOOPLIB_EXIT_FILE": str(status),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "--tee", "3", "-m", "looplib.train", *JOB, *overrides,
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    said: dict[int, list[str]] = {0: [], 1: []}
    for rank, line in re.findall(r"^\[default(\d)\]:(looplib: .*)$", out, re.M):
        said[int(rank)].append(line)
    worker_lines = "\n".join(re.findall(r"^\[default\d\]:.*$", out, re.M))
    assert "Traceback" not in worker_lines and "SIGTERM" not in worker_lines and "preempt" not in worker_lines, out
    assert r.returncode != 0
    assert not (tmp_path / "run").exists(), out  # refused before training: the directory it made is gone
    return said, out, status.read_text().strip()


@pytest.mark.parametrize("refuser", [1, 0])
def test_the_rank_that_refuses_says_why_and_the_other_says_it_stopped_because_of_it(tmp_path, refuser):
    """A setting only one rank refuses (tests/refusing.py), forced on rank 1 (the case whose line
    was lost: torchrun stopped rank 0 first) and on rank 0."""
    said, out, status = torchrun(tmp_path, "+precision._target_=refusing.RefuseOnRank", f"+precision.rank={refuser}")
    assert said[refuser] == [f"looplib: error: precision.rank: rank {refuser} refuses this job (a test's setting); "
                             "leave precision.rank out"], out
    assert said[1 - refuser] == [f"looplib: stopped: rank {refuser} refused the job, so the other ranks stopped too "
                                 "(nothing was trained)"], out
    assert status == "2"


CASES = [["lr=-1"], ["+engine=fsdp", "+optim=adafactor"],
         pytest.param(["+engine=fsdp", "+peft=qlora"],
                      marks=pytest.mark.skipif(not has_bitsandbytes(), reason="bitsandbytes is not installed"))]


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o))
def test_a_refusal_every_rank_makes_is_said_once_and_never_lost(tmp_path, overrides):
    """Both ranks refuse alike, whichever gets there first: the refusal is said (once), and a rank
    stopped before it refused itself says which rank refused; the exit file holds 2."""
    said, out, status = torchrun(tmp_path, *overrides)
    errors = [(rank, line) for rank in said for line in said[rank] if line.startswith("looplib: error: ")]
    assert len(errors) == 1, out
    first = errors[0][0]
    assert said[first] == [errors[0][1]]
    assert said[1 - first] in ([], [f"looplib: stopped: rank {first} refused the job, so the other ranks stopped "
                                    "too (nothing was trained)"]), out
    assert status == "2"

"""loss=distill under +engine=ddp and +engine=fsdp: two processes of batch 2 = one process of batch 4
(the window's tokens are counted over both ranks; the teacher is placed on each under DDP, sharded
beside the student under FSDP2 (``FSDP.place_frozen``); the two logged terms are summed over both)."""
import json

import pytest
from safetensors.torch import load_file

from conftest import run_cli
from test_distill_cli import TINY, teacher  # noqa: F401 (the fixture: a finished looplib run)
from test_engines_ddp import LOSS_RTOL, WEIGHT_ATOL, torchrun


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_processes_equal_one_process_of_twice_the_batch(teacher, token_cache, monkeypatch, engine):  # noqa: F811
    job = ["data=instruct", f"data.path={teacher / 'inst.jsonl'}", "loss=distill",
           f"loss.teacher={teacher / 'teacher'}",
           "loss.temperature=2", "loss.kind=reverse_kl", *TINY, "model.d_model=16", "max_steps=3", "eval_every=3",
           "+optim=sgd", "optim.momentum=0"]
    monkeypatch.setenv("LOOPLIB_CACHE", token_cache)  # the teacher's tokens, cached
    one, two_dir = f"one_{engine}", f"two_{engine}"
    r = run_cli(*job, "batch_size=4", f"hydra.run.dir={teacher / one}", cwd=teacher)
    assert r.returncode == 0, r.stderr
    two = torchrun(f"+engine={engine}", *job, "batch_size=2", f"hydra.run.dir={teacher / two_dir}", cwd=teacher)
    assert two.returncode == 0, two.stderr
    read = lambda run: [json.loads(x) for x in (teacher / run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    compared = 0
    for a, b in zip(read(two_dir), read(one)):
        for key in ("loss", "loss_ce", "loss_distill", "eval_loss", "eval_loss_ce", "eval_loss_distill"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=LOSS_RTOL, abs=1e-7), key
                compared += 1
    assert compared >= 12
    weights = load_file(teacher / two_dir / "model.safetensors")
    expected = load_file(teacher / one / "model.safetensors")
    assert weights.keys() == expected.keys()
    assert max((weights[k] - expected[k]).abs().max().item() for k in expected) < WEIGHT_ATOL

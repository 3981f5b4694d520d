"""FSDP2: a forward without gradients before training (an evaluation, GRPO's sampling, DPO's
reference pass) leaves the first updates exactly as without it.

Such a forward used to leave the root (and, with engine.reshard_after_forward=false, every block)
gathered: ``model.parameters()`` then yielded the gathered tensors, an optimizer built then never
updated the root and stepped into freed storage (a segfault at exit); a first forward under
inference mode (looplib's evaluation) left inference tensors that training's gathers could not
write. Weights after two steps, bit for bit, with and without the pass, under both reshard settings."""
import torch

import dist_workers as W
import no_grad_workers as N


def test_a_forward_without_gradients_before_training_changes_nothing(tmp_path):
    W.spawn(N.worker, 2, tmp_path)
    got = torch.load(tmp_path / "no_grad.pt", weights_only=True)
    for reshard in (True, False):
        plain = got[f"none/{reshard}"]
        for name in N.PASSES:
            weights = got[f"{name}/{reshard}"]
            assert weights.keys() == plain.keys()
            changed = [k for k in plain if not torch.equal(weights[k], plain[k])]
            assert not changed, (name, reshard, changed)
    # the two steps moved the weights (the root's too): a pass that froze them would show
    start = W.tiny_gpt().state_dict()
    assert all(not torch.equal(got["none/True"][k], start[k]) for k in ("tok_emb.weight", "ln_f.weight"))


def test_dpo_precomputed_under_fsdp_equals_its_cache_read_and_one_process(tmp_path, monkeypatch):
    """loss.reference=precomputed under +engine=fsdp: the pass over every pair before training (the
    sharded model in eval mode, without gradients) leaves training as a run that reads the pass's
    cache and runs no forward before it (bit for bit), and as one process of twice the batch with the
    live frozen copy (to the engines' tolerance)."""
    import json

    from safetensors.torch import load_file

    from conftest import run_cli
    from test_engines_ddp import LOSS_RTOL, WEIGHT_ATOL, torchrun
    from test_preference import TINY, write_pairs

    import pytest

    monkeypatch.setenv("LOOPLIB_CACHE", str(tmp_path / "cache"))  # the pass's cache: this test's own
    job = ["data=preference", f"data.path={write_pairs(tmp_path)}", "loss=dpo", *TINY, "max_steps=3", "eval_every=3",
           "+optim=sgd", "optim.momentum=0", "lr=0.05"]
    job = [a for a in job if not a.startswith("batch_size=")]
    runs = {}
    for name in ("computed", "read"):
        r = torchrun("+engine=fsdp", *job, "loss.reference=precomputed", "batch_size=2",
                     f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        runs[name] = r.stdout + r.stderr
    assert "computed in" in runs["computed"] and "read from" in runs["read"]
    one = run_cli(*job, "batch_size=4", f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    computed, read, live = (load_file(tmp_path / run / "model.safetensors") for run in ("computed", "read", "one"))
    assert computed.keys() == read.keys() == live.keys()
    assert all(torch.equal(computed[k], read[k]) for k in computed)
    for k in live:
        torch.testing.assert_close(computed[k], live[k], atol=WEIGHT_ATOL, rtol=0)
    rows = lambda run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    pairs = [(a, b) for a, b in zip(rows("computed"), rows("one")) if "loss" in b]
    assert len(pairs) == 3 and pairs[-1][1]["loss"] != pytest.approx(pairs[0][1]["loss"])  # the policy moved
    for a, b in pairs:
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL, abs=1e-6)


def test_dpo_frozen_copy_sharded_under_fsdp_trains_as_one_process(tmp_path, monkeypatch):
    """loss=dpo without +peft under +engine=fsdp: the frozen copy, taken before the policy is sharded,
    is sharded as the policy (looplib.engines.fsdp.FSDP.place_frozen); two processes train as one
    process of twice the batch with its whole copy (to the engines' tolerance)."""
    import json

    import pytest
    from safetensors.torch import load_file

    from conftest import run_cli
    from test_engines_ddp import LOSS_RTOL, WEIGHT_ATOL, torchrun
    from test_preference import TINY, write_pairs

    monkeypatch.setenv("LOOPLIB_CACHE", str(tmp_path / "cache"))  # the pass's cache: this test's own
    job = ["data=preference", f"data.path={write_pairs(tmp_path)}", "loss=dpo", *TINY, "max_steps=3", "eval_every=3",
           "+optim=sgd", "optim.momentum=0", "lr=0.05"]
    job = [a for a in job if not a.startswith("batch_size=")]
    two = torchrun("+engine=fsdp", *job, "batch_size=2", f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    assert "a frozen copy of the starting weights, sharded" in two.stdout + two.stderr
    one = run_cli(*job, "batch_size=4", f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    a, b = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=WEIGHT_ATOL, rtol=0)
    rows = lambda run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    pairs = list(zip(rows("two"), rows("one")))
    assert sum("loss" in b for _, b in pairs) == 3
    for x, y in pairs:
        for key in ("loss", "eval_loss", "reward_margin", "eval_reward_margin"):
            if key in y:
                assert x[key] == pytest.approx(y[key], rel=LOSS_RTOL, abs=1e-6), key
    assert [y["reward_margin"] for _, y in pairs if "loss" in y][-1] != 0  # the policy left its reference

"""torch.compile through the command line (the in-process tests: tests/unit/test_compile.py)."""
import hydra
import pytest
import torch
from omegaconf import OmegaConf
from looplib import SGD, Accumulation, TorchCompile, fit
from looplib.evaluation import evaluate
from looplib.precision import Precision
from looplib.engines import Engine
from looplib.loss import TokenCrossEntropy

from conftest import REPO, random_tokens, tiny_gpt


@pytest.mark.slow
def test_compiled_model_trains_like_the_eager_one_with_accumulation():
    strategy = hydra.utils.instantiate(OmegaConf.load(REPO / "conf" / "compile" / "default.yaml"))
    assert isinstance(strategy, TorchCompile) and strategy.mode == "default"
    data = torch.utils.data.DataLoader(random_tokens(n=8), batch_size=2)
    eval_batches = [next(iter(data))]
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model = tiny_gpt()
        keys = list(model.state_dict())
        if compiled:
            model = strategy.wrap(model)
            assert type(model).__name__ == "GPT" and list(model.state_dict()) == keys  # compiled in place
        opt = SGD(lr=0.5).build(model)  # linear in the gradient: differences stay at rounding level
        fit(model, data, objective=TokenCrossEntropy(), optimizer=opt, accumulation=Accumulation(2), max_steps=2)
        loss = evaluate(model, eval_batches, TokenCrossEntropy(), Precision(), Engine("cpu"))
        runs.append((torch.cat([p.detach().flatten() for p in model.parameters()]), loss))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames >= 1, "nothing was compiled"
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-4, atol=1e-5)
    assert runs[1][1] == pytest.approx(runs[0][1], rel=1e-4)
    assert not torch.equal(runs[0][0], torch.cat([p.detach().flatten() for p in tiny_gpt().parameters()]))


def test_compile_keys_through_the_command_line(tmp_path, token_cache):
    """compile.regional and compile.optimizer as typed: it trains (no step skipped, the compile
    cost in every row); the fused optimizer is refused at build time, in one line, nothing written."""
    import json
    from conftest import run_cli
    args = ["data=random", "model.n_layer=3", "model.d_model=32", "model.seq_len=16", "batch_size=4", "max_steps=3",
            "log_every=1", "eval_every=0", "eval_samples=0", "sample_tokens=0", "checkpoint.enabled=false",
            "+optim=adamw", "+compile=default", "compile.backend=aot_eager", "compile.regional=true",
            "compile.optimizer=true"]
    r = run_cli(*args, "optim.impl=foreach", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "loss" in row]
    assert [row["skipped_steps"] for row in train] == [0, 0, 0] and train[-1]["compiles"] >= 2
    r = run_cli(*args, "optim.impl=fused", f"hydra.run.dir={tmp_path / 'fused'}", cwd=tmp_path,
                env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 2 and r.stderr.strip().startswith("looplib: error: compile.optimizer: optim.impl=fused")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "fused").exists()

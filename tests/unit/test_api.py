"""The loop without Hydra: train_model builds what the CLI builds, and a script that uses it
never imports Hydra or OmegaConf."""
import json
import subprocess
import sys
import textwrap

import torch

from looplib import (BF16, SGD, Accumulation, AdamW, Engine, Epochs, HalfWeights, TokenCrossEntropy,
                     WarmupCosine, build_loader, fit, train_model)

from conftest import REPO, random_tokens, tiny_gpt


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_train_model_equals_fit_with_hand_built_pieces():
    data = random_tokens(n=24)
    result = train_model(tiny_gpt(), data, max_steps=5, batch_size=4, accum_steps=2, precision=BF16(),
                         optim=AdamW(lr=3e-3, weight_decay=0.1), schedule=WarmupCosine(warmup_steps=2),
                         max_grad_norm=1.0, device="cpu", seed=3)
    assert result.state.step == 5
    # the same run, every piece built by hand
    model, precision, engine = tiny_gpt(), BF16(), Engine("cpu")
    precision.setup(engine.device)
    optimizer = AdamW(lr=3e-3, weight_decay=0.1).build(model)
    fit(model, Epochs(build_loader(data, batch_size=4, seed=3)), objective=TokenCrossEntropy(),
        optimizer=optimizer, scheduler=WarmupCosine(warmup_steps=2).build(optimizer, 5), precision=precision,
        accumulation=Accumulation(2), engine=engine, max_steps=5, max_grad_norm=1.0)
    assert torch.equal(flat(result.model), flat(model))
    assert not torch.equal(flat(model), flat(tiny_gpt()))


def test_train_model_evaluates_and_writes_metrics(tmp_path):
    data = random_tokens(n=16)
    result = train_model(tiny_gpt(), data, max_steps=4, batch_size=4, optim=SGD(lr=0.5), eval_dataset=data,
                         eval_every=2, eval_samples=8, evaluation=HalfWeights("bfloat16"), metrics=tmp_path / "m.jsonl",
                         log_every=1, device="cpu")
    rows = (tmp_path / "m.jsonl").read_text().splitlines()
    assert sum('"eval_loss"' in r for r in rows) == 2 and sum('"loss"' in r for r in rows) == 4
    assert result.eval_loss is not None and all(p.dtype == torch.float32 for p in result.model.parameters())


SCRIPT = """
import sys
import torch
from looplib import BF16, AdamW, RandomTokens, train_model
from looplib import DDP, FSDP, DeepSpeed, MLflow, TensorBoard, WandB  # the docs name them beside BF16()
from looplib.models import GPT

torch.manual_seed(0)
model = GPT(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
data = RandomTokens(32, 16, 64)
first = train_model(model, data, max_steps=1, optim=AdamW(lr=1e-2), eval_dataset=data, device="cpu").eval_loss
result = train_model(model, data, max_steps=30, batch_size=8, accum_steps=2, precision=BF16(),
                     optim=AdamW(lr=1e-2), eval_dataset=data, device="cpu")
print(first, result.eval_loss)
assert result.eval_loss < first - 0.2, (first, result.eval_loss)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("hydra", "omegaconf", "peft", "transformers",
                                                              "matplotlib", "bitsandbytes", "tensorboard",
                                                              "mlflow", "wandb", "deepspeed"))
assert not heavy, heavy  # the engines and trackers are classes until built: their libraries are not imported
import os
os.environ["LOOPLIB_PLOT"] = "0"  # no loss.png: matplotlib is a library of its own
again = train_model(model, data, max_steps=2, batch_size=8, device="cpu", run_dir="run", checkpoint_every=1)
assert (again.run_dir / "config.yaml").exists() and len(list((again.run_dir / "checkpoints").iterdir())) == 2
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("hydra", "omegaconf"))
assert not heavy, heavy  # a run directory with checkpoints, still without Hydra
print("ok")
"""


def test_a_script_trains_without_importing_hydra(tmp_path):
    script = tmp_path / "train_by_hand.py"
    script.write_text(textwrap.dedent(SCRIPT))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok")
    # it speaks like the CLI: no logging configured, so looplib's handler prints its lines (not a terminal: lines)
    assert "[looplib] step 30/30  loss " in r.stderr and "[looplib] step 30: eval loss " in r.stderr, r.stderr


def test_metrics_never_appends_to_another_runs_file(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 99, "loss": 1.0}\n')
    train_model(tiny_gpt(), random_tokens(n=8), max_steps=2, batch_size=4, metrics=path, log_every=1, device="cpu")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "held an earlier run's rows: starting it afresh" in caplog.text


def test_the_readme_example_runs(tmp_path, monkeypatch):
    """docs/python-api.md's first example, as written (fewer steps, on the CPU)."""
    text = (REPO / "docs" / "python-api.md").read_text()
    code = text.split("```python", 1)[1].split("```", 1)[0]
    assert "train_model(" in code
    code = code.replace("max_steps=1000", "max_steps=2").replace('device="auto"', 'device="cpu"')
    monkeypatch.chdir(tmp_path)
    namespace = {"MyModel": tiny_gpt, "my_dataset": random_tokens(n=16), "my_held_out": random_tokens(n=8, seed=1)}
    exec(compile(code, "docs/python-api.md", "exec"), namespace)
    assert namespace["result"].state.step == 2 and (tmp_path / "metrics.jsonl").exists()


def test_the_same_job_both_ways_with_each_ones_defaults_trains_bit_for_bit(tmp_path, monkeypatch):
    """A job built the same way from Python and on the command line, every setting left at each
    one's default (seed 1337 both ways, batch 32, AdamW at 2e-3, an evaluation, a checkpoint and a
    sample at the end, ...): the same rows, weights and sample, bit for bit; the Python run's
    config.yaml records what ran (the optimizer's lr, no unused top-level lr beside it)."""
    from safetensors.torch import load_file

    from conftest import run_cli
    from looplib import RandomCorpus
    from looplib.models import GPT
    from looplib.run.checkpoint_dir import read_config
    r = run_cli("data=random", "data.vocab_size=64", "data.n_train=64", "data.n_eval=16", "model.n_layer=1",
                "model.d_model=32", "model.n_head=2", "model.seq_len=16", "max_steps=4",
                f"hydra.run.dir={tmp_path / 'cli'}", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    monkeypatch.setenv("LOOPLIB_PLOT", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command line ran (OMP_NUM_THREADS=1): the same order of sums
    try:
        torch.manual_seed(1337)  # as the docs say: seed before building the model, as the command line does
        model = GPT(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)
        train_model(model, RandomCorpus(seq_len=16, vocab_size=64, n_train=64, n_eval=16), max_steps=4,
                    run_dir=tmp_path / "api")
    finally:
        torch.set_num_threads(threads)
    cli, api = tmp_path / "cli", tmp_path / "api"

    def rows(run):
        keep = ("step", "loss", "lr", "grad_norm", "eval_loss")
        return [{k: row[k] for k in keep if k in row} for row in map(json.loads, (run / "metrics.jsonl").read_text()
                                                                       .splitlines()) if "loss" in row or "eval_loss" in row]
    assert rows(cli)[-1]["step"] == 4 and any("eval_loss" in row for row in rows(cli))
    assert rows(cli) == rows(api)
    a, b = load_file(cli / "model.safetensors"), load_file(api / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (cli / "sample.txt").read_text() == (api / "sample.txt").read_text()
    assert sorted(p.name for p in (cli / "checkpoints").iterdir()) == ["step-00000004"]
    assert sorted(p.name for p in (api / "checkpoints").iterdir()) == ["step-00000004"]
    saved, typed = read_config(api / "config.yaml"), read_config(cli / "config.yaml")
    assert "lr" not in saved and "weight_decay" not in saved and saved["optim"]["lr"] == typed["optim"]["lr"] == 2e-3
    assert {k: saved[k] for k in saved if not isinstance(saved[k], dict)} == \
        {k: typed[k] for k in typed if not isinstance(typed[k], dict) and k not in ("lr", "weight_decay")}

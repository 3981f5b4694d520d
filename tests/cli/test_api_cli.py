"""train_model against the command line, and a script that trains without importing Hydra (in a fresh interpreter); the in-process tests: tests/unit/test_api.py."""
import json
import subprocess
import sys
import textwrap
import torch
from looplib import train_model


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


def test_the_same_job_both_ways_with_each_ones_defaults_trains_bit_for_bit(tmp_path, monkeypatch):
    """A job built the same way from Python and on the command line, every setting left at each
    one's default (seed 1337 both ways, batch 32, AdamW at 2e-3, an evaluation, a checkpoint and a
    sample at the end, ...): the same rows, weights and sample, bit for bit; the Python run's
    config.yaml records what ran (the optimizer's lr, no unused top-level lr beside it)."""
    from safetensors.torch import load_file

    from conftest import run_cli
    from looplib import RandomCorpus
    from looplib.models import GPT
    from looplib.store.checkpoint_dir import read_config
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

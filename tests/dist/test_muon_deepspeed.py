"""+optim=muon under +engine=deepspeed: DeepSpeed's own Muon (0.19.8), what it cannot do refused in one line."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'looplib[deepspeed]')")

LLAMA = ["model=llama_tiny", "data=random", "model.hidden_size=32", "model.intermediate_size=64",
         "model.num_hidden_layers=2", "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.seq_len=16",
         "batch_size=4", "accum_steps=2", "max_steps=4", "log_every=1", "eval_every=0", "eval_samples=0",
         "sample_tokens=0", "+optim=muon", "optim.adjust_lr=original", "optim.lr=0.02", "optim.adam_lr=0.003",
         "max_grad_norm=0", "+schedule=wsd", "schedule.warmup_steps=1", "schedule.decay_fraction=0.5"]
# DeepSpeed compiles its Newton-Schulz with torch.compile at the first step: eager here (minutes on a CPU otherwise)
ENV = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}


def losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def test_deepspeed_steps_its_own_muon_close_to_torchs_and_resumes_exactly(tmp_path):
    """ZeRO-2 on one process against torch's Muon on the local engine: the same split (a Llama's
    names agree with looplib's blocks), each group's lr from the schedule; DeepSpeed's bf16
    Newton-Schulz and its Adam differ from torch's by rounding (measured 5e-3 on the weights
    after 4 steps at lr 0.02). Its own checkpoint resumes bit for bit, the schedule setting the
    learning rates of the param groups DeepSpeed's load made."""
    local, ds, resumed = tmp_path / "local", tmp_path / "ds", tmp_path / "resumed"
    r = run_cli(*LLAMA, f"hydra.run.dir={local}", cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    common = [*LLAMA, "+engine=deepspeed", "checkpoint.every_steps=2", "checkpoint.keep=3"]
    r = run_cli(*common, f"hydra.run.dir={ds}", cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    assert '"type": "Muon"' in r.stdout and '"ns_method": "standard"' in r.stdout  # the derived config, printed
    assert losses(ds) == pytest.approx(losses(local), rel=2e-3)
    a, b = load_file(local / "hf" / "model.safetensors"), load_file(ds / "hf" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-2, rtol=0)
    lrs = [r["lr"] for r in map(json.loads, (ds / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert lrs == pytest.approx([0.02, 0.02, 0.01, 0.0])  # wsd: the last 2 of 4 steps cool down
    r = run_cli(*common, f"resume={ds / 'checkpoints' / 'step-00000002'}", f"hydra.run.dir={resumed}", cwd=tmp_path,
                env=ENV)
    assert r.returncode == 0, r.stderr
    c = load_file(resumed / "hf" / "model.safetensors")
    assert all(torch.equal(b[k], c[k]) for k in b)
    assert losses(resumed) == {s: losses(ds)[s] for s in (3, 4)}
    # on two processes: DeepSpeed's universal checkpoint cannot carry Muon's state; refused in one line
    from test_engines_ddp import torchrun
    r = torchrun(*common, f"resume={ds / 'checkpoints' / 'step-00000002'}", f"hydra.run.dir={tmp_path / 'two'}",
                 cwd=tmp_path)
    said = [x for x in r.stderr.splitlines() if x.startswith("looplib: error:")]
    assert r.returncode != 0 and said and all(x.startswith("looplib: error: resume: a DeepSpeed checkpoint of "
                                                           "+optim=muon cannot move to another number of processes")
                                              for x in said)


@pytest.mark.parametrize("args, line", [
    (["optim.adjust_lr=match_rms_adamw"], "optim.adjust_lr: +engine=deepspeed runs DeepSpeed's own Muon, which has "
     "adjust_lr=original only (got optim.adjust_lr=match_rms_adamw); set optim.adjust_lr=original, and an lr on its "
     "scale (e.g. optim.lr=0.02), or use +engine=fsdp / ddp for torch's Muon"),
    (["optim.ns_steps=6"], "optim.ns_steps: +engine=deepspeed runs DeepSpeed's own Muon, which has ns_steps=5 only"),
    (["max_grad_norm=1"], "max_grad_norm: +optim=muon under ZeRO stage 2: DeepSpeed 0.19.8 writes Muon's "
     "orthogonalised update into the gradient partitions and then clips by their norm"),
    (["model=tiny", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16"],
     "optim: +engine=deepspeed chooses Muon's matrices by name (2-D, no 'embed' or 'lm_head' in it): it would give "
     "tok_emb.weight to Muon, which looplib gives to AdamW"),
], ids=["adjust_lr", "ns_steps", "clipping", "gpt_names"])
def test_what_deepspeeds_muon_cannot_do_is_refused_in_one_line(tmp_path, args, line):
    job = [a for a in LLAMA if not (a.startswith("model") and "model=tiny" in args)]
    r = run_cli(*job, "+engine=deepspeed", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=ENV)
    errors = [x for x in r.stderr.splitlines() if x.startswith("looplib: error:")]
    assert r.returncode == 2 and len(errors) == 1 and errors[0].startswith("looplib: error: " + line), r.stderr
    assert "Traceback" not in r.stderr

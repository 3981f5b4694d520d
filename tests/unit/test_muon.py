"""+optim=muon: torch.optim.Muon on the hidden matrices, AdamW on the rest, as one optimizer."""
import re

import pytest
import torch

import dist_workers as W
from conftest import random_tokens, run_cli, tiny_gpt
from looplib.errors import ConfigError
from looplib.loss import TokenCrossEntropy
from looplib.muon import Muon, MuonAdamW, hidden_matrices
from looplib.schedule import WSD

GPT_MATRICES = r"blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(0|2))\.weight"
LLAMA_MATRICES = r".*layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"


def tiny_llama():
    pytest.importorskip("transformers")
    from looplib.hf.models import CausalLM
    torch.manual_seed(0)
    return CausalLM(seq_len=16, model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)


def by_hand(model, pattern, lr, adam_lr, wd, adam_wd):
    """The reference: torch.optim.Muon on the parameters named by ``pattern``, torch.optim.AdamW
    on the rest (2-D outside the blocks and not an embedding: decayed; the rest not)."""
    names = dict(model.named_parameters())
    matrices = [p for n, p in names.items() if re.fullmatch(pattern, n)]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    rest = [p for n, p in names.items() if not re.fullmatch(pattern, n)]
    decayed = [p for p in rest if p.ndim == 2 and id(p) not in embeddings]
    plain = [p for p in rest if p.ndim != 2 or id(p) in embeddings]
    muon = torch.optim.Muon(matrices, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw")
    groups = [g for g in ({"params": decayed, "weight_decay": adam_wd}, {"params": plain, "weight_decay": 0.0})
              if g["params"]]
    adamw = torch.optim.AdamW(groups, lr=adam_lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    return [muon, adamw], matrices


@pytest.mark.parametrize("make, pattern, count", [(tiny_gpt, GPT_MATRICES, 2 * 4), (tiny_llama, LLAMA_MATRICES, 2 * 7)],
                         ids=["gpt", "llama"])
def test_update_equals_torch_muon_plus_adamw_bit_for_bit(make, pattern, count):
    """The blocks found from the structure (GPT's ``blocks``, Llama's ``model.layers`` inside
    looplib's wrapper), each family with its own lr and weight decay, three steps."""
    ours, ref = make(), make()
    factory = Muon(lr=2e-2, weight_decay=0.05, adam_lr=3e-3, adam_weight_decay=0.2)
    opt = factory.build(ours)
    assert isinstance(opt, MuonAdamW) and opt.param_groups[0]["use_muon"]
    reference, matrices = by_hand(ref, pattern, 2e-2, 3e-3, 0.05, 0.2)
    names = {id(p): n for n, p in ours.named_parameters()}
    ref_names = {id(p): n for n, p in ref.named_parameters()}
    assert [names[id(p)] for p in opt.param_groups[0]["params"]] == [ref_names[id(p)] for p in matrices]
    assert len(matrices) == count
    data, objective = random_tokens(8), TokenCrossEntropy()
    for step in range(3):
        batch = {k: torch.stack([data[i][k] for i in range(4 * (step % 2), 4 * (step % 2) + 4)]) for k in data[0]}
        for model, optimizers in ((ours, [opt]), (ref, reference)):
            objective(model, batch).backward()
            for o in optimizers:
                o.step()
                o.zero_grad()
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


def test_state_dict_round_trips_and_a_schedule_scales_both_families():
    """A fresh optimizer loaded from ``state_dict()`` continues exactly as the one that saved it;
    the schedule's factor multiplies Muon's lr and AdamW's alike."""
    data, objective = random_tokens(8), TokenCrossEntropy()
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in data[0]}
    a = tiny_gpt()
    factory = Muon(lr=2e-2, adam_lr=4e-3)
    opt = factory.build(a)
    sched = WSD(warmup_steps=2, decay_fraction=0.5).build(opt, 6)
    for _ in range(3):
        objective(a, batch).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2e-2, 4e-3])  # step 3 of 6: stable
    b = tiny_gpt()
    b.load_state_dict(a.state_dict())
    opt_b = factory.build(b)
    sched_b = WSD(warmup_steps=2, decay_fraction=0.5).build(opt_b, 6)  # as a resume does: build, then load
    opt_b.load_state_dict(torch.load(save(opt.state_dict()), weights_only=True))
    sched_b.load_state_dict(sched.state_dict())
    state = opt_b.state[opt_b.param_groups[0]["params"][0]]
    assert set(state) == {"momentum_buffer"}
    assert set(opt_b.state[opt_b.param_groups[1]["params"][0]]) == {"step", "exp_avg", "exp_avg_sq"}
    for model, o, s in ((a, opt, sched), (b, opt_b, sched_b)):
        for _ in range(2):
            objective(model, batch).backward()
            o.step()
            s.step()
            o.zero_grad()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2e-2 / 3, 4e-3 / 3])  # 1 of 3 cool-down steps left
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def save(state):
    import io
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_the_planner_counts_one_buffer_per_muon_matrix_and_two_for_the_rest():
    from looplib.plan import optimizer_state_bytes_of, state_tensor_bytes
    model = tiny_gpt()
    factory = Muon()
    matrices = {id(p) for p in hidden_matrices(model)}
    params = list(model.parameters())
    rule = optimizer_state_bytes_of(factory, model)
    assert rule == sum(4 * p.numel() for p in params if id(p) in matrices) + \
        sum(8 * p.numel() + 4 for p in params if id(p) not in matrices)  # two moments and a step
    opt = factory.build(model)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    assert rule == state_tensor_bytes(opt)


def test_refusals_are_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError) as err:
        Muon().build(model)
    assert err.value.key == "optim.blocks" and "found no trainable 2-D weight" in str(err.value)
    assert len(Muon(blocks=["Linear"]).build(model).param_groups[0]["params"]) == 2  # named: taken
    from looplib.engines.fsdp import FSDP
    from looplib.precision import FP32
    engine = FSDP.__new__(FSDP)  # only its check: no process group
    engine.offload, engine.device, engine.reduce_dtype = "cpu", torch.device("cuda"), "float32"
    with pytest.raises(ConfigError) as err:
        engine.check(None, FP32(), Muon())
    assert err.value.key == "engine.offload" and "Newton-Schulz" in str(err.value)


@pytest.mark.parametrize("args, line", [
    (["+optim=muon", "optim.ns_steps=0"],
     "looplib: error: optim.ns_steps: optim.ns_steps must be >= 1 and <= 99 (got optim.ns_steps=0) (from optim=muon); "
     "use a whole number >= 1 and <= 99, e.g. optim.ns_steps=5 (the default)"),
    (["+optim=muon", "optim.adjust_lr=rms"],
     "looplib: error: optim.adjust_lr: optim.adjust_lr='rms' is not one of original or match_rms_adamw (from "
     "optim=muon); use one of original or match_rms_adamw, e.g. optim.adjust_lr=match_rms_adamw (the default)"),
    (["+optim=muon", "+peft=lora"],
     "looplib: error: optim: +optim=muon with +peft=lora: Muon orthogonalises whole weight matrices, and an adapter "
     "trains low-rank factors of a frozen base (not what Muon's update is defined or tuned for); use +optim=adamw "
     "with LoRA/QLoRA, or train the whole model with +optim=muon"),
    (["+schedule=wsd", "schedule.decay_fraction=1.5"],
     "looplib: error: schedule.decay_fraction: schedule.decay_fraction must be >= 0 and <= 1 (got "
     "schedule.decay_fraction=1.5) (from schedule=wsd); use a number >= 0 and <= 1, e.g. "
     "schedule.decay_fraction=0.2 (the default)"),
    (["+schedule=wsd", "schedule.decay_shape=sqrt"],
     "looplib: error: schedule.decay_shape: schedule.decay_shape='sqrt' is not one of linear, cosine or 1-sqrt "
     "(from schedule=wsd); use one of linear, cosine or 1-sqrt, e.g. schedule.decay_shape=linear (the default)"),
])
def test_bad_keys_get_one_line_and_exit_2(tmp_path, args, line):
    r = run_cli("data=random", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert (r.returncode, r.stderr.strip(), r.stdout) == (2, line, "")
    assert not (tmp_path / "run").exists()


def test_two_processes_under_ddp_and_fsdp_equal_one_within_1e_5(tmp_path):
    """Same global batch: DDP all-reduces the gradients; FSDP2 reduce-scatters them, and each
    Muon matrix's update is gathered whole for Newton-Schulz on every rank. With Newton-Schulz in
    fp32 the weights agree within 1e-5 (measured 6.8e-6, on a bias: AdamW's 1/sqrt(v)), and DDP
    and FSDP bit for bit. torch's bf16 Newton-Schulz turns the gradients' last-bit differences
    (two ranks sum in another order) into bf16 roundings: losses agree to 2e-6 relative, the
    matrices to about 1e-3 after 4 steps (docs/command-line.md#muon)."""
    W.spawn(W.muon_worker, 2, tmp_path)
    got = torch.load(tmp_path / "muon.pt", weights_only=True)
    losses, weights = W.local_reference(W.STEPS, W.muon(ns_dtype="fp32"))
    for run in ("ddp fp32", "fsdp fp32"):
        assert len(got[run]["muon"]) == 8, run
        assert got[run]["losses"] == pytest.approx(losses, rel=1e-6), run
        for name, value in weights.items():
            torch.testing.assert_close(got[run]["weights"][name], value, atol=1e-5, rtol=0, msg=f"{run} {name}")
            assert torch.equal(got["ddp fp32"]["weights"][name], got["fsdp fp32"]["weights"][name]), name
    bf16_losses, _ = W.local_reference(W.STEPS, W.muon())
    assert got["fsdp bf16"]["losses"] == pytest.approx(bf16_losses, rel=1e-5)


def test_fp32_newton_schulz_is_torchs_iteration_in_fp32():
    from torch.optim._muon import _zeropower_via_newtonschulz
    from looplib.muon import NS_COEFFICIENTS, newton_schulz
    torch.manual_seed(0)
    for shape in ((24, 8), (8, 24), (16, 16)):
        g = torch.randn(shape)
        assert torch.equal(newton_schulz(g, NS_COEFFICIENTS, 5, 1e-7, "bf16"),
                           _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7))
        fp32 = newton_schulz(g, NS_COEFFICIENTS, 5, 1e-7, "fp32")
        assert fp32.dtype == torch.float32 and fp32.shape == g.shape
        torch.testing.assert_close(fp32, _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7).float(),
                                   atol=3e-2, rtol=0)  # bf16's rounding, five iterations deep
        singular = torch.linalg.svdvals(fp32)
        assert 0.3 < singular.min() and singular.max() < 1.3  # roughly orthogonal (Muon's five steps: about 0.5-1.2)


MUON_JOB = ["data=random", "data.n_train=128", "model.seq_len=32", "model.n_layer=2", "model.d_model=64",
            "batch_size=4", "accum_steps=2", "max_steps=8", "log_every=1", "eval_every=0", "eval_samples=4",
            "sample_tokens=0", "progress=lines", "+optim=muon", "optim.ns_dtype=fp32", "+schedule=wsd",
            "schedule.warmup_steps=2", "schedule.decay_fraction=0.5"]


def wsd_lr(step: int, lr: float = 2e-3, warmup: int = 2, total: int = 8, decay: int = 4) -> float:
    """WSD's lr after ``step`` optimizer steps, written out: what the metrics row of that step logs."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step < total - decay:
        return lr
    return lr * (1 - (step - (total - decay)) / decay)


def test_a_muon_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path):
    """SIGTERM mid-run: a checkpoint, exit 75; resume=auto finishes bit for bit as the run that
    was never stopped, the wsd lr equal to its formula at every step on both. The uninterrupted
    run's step-4 checkpoint resumed on two processes under FSDP2 (the accumulation halves, the
    global batch stays) continues within 1e-5."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from safetensors.torch import load_file
    from test_engines_ddp import torchrun

    def rows(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    ref = tmp_path / "ref"
    r = run_cli(*MUON_JOB, "checkpoint.every_steps=4", f"hydra.run.dir={ref}", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "looplib.train", *MUON_JOB, "checkpoint.every_steps=0",
                             f"hydra.run.dir={run}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and (not (run / "metrics.jsonl").exists() or len(rows(run)) < 2):
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err
    assert 2 <= int(next((run / "checkpoints").iterdir()).name.split("-")[1]) < 8
    r = run_cli(*MUON_JOB, "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    a, b = load_file(ref / "model.safetensors"), load_file(run / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for done in (ref, run):
        train = [m for m in rows(done) if "loss" in m]
        assert [m["step"] for m in train] == list(range(1, 9))
        assert [m["lr"] for m in train] == pytest.approx([wsd_lr(m["step"]) for m in train], rel=1e-12)
    assert [m["loss"] for m in rows(run) if "loss" in m] == [m["loss"] for m in rows(ref) if "loss" in m]

    two = tmp_path / "two"
    r = torchrun(*MUON_JOB, "+engine=fsdp", f"resume={ref / 'checkpoints' / 'step-00000004'}",
                 f"hydra.run.dir={two}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "accum_steps 2 -> 1, global batch 8 kept" in r.stdout
    ref_losses = {m["step"]: m["loss"] for m in rows(ref) if "loss" in m}
    assert {m["step"]: m["loss"] for m in rows(two) if "loss" in m} == pytest.approx(
        {s: ref_losses[s] for s in range(5, 9)}, rel=1e-5)
    c = load_file(two / "model.safetensors")
    for k in a:
        torch.testing.assert_close(c[k], a[k], atol=1e-5, rtol=0)


def test_tune_searches_muon_with_numerics_allowed_and_checks_it_against_the_jobs_loss(tmp_path):
    from looplib.tune.space import device_options
    assert "muon" in device_options(torch.device("cpu"), 1, "looplib.loss.TokenCrossEntropy")["optim"]
    from test_tune import BARE, TINY, tune
    r, result = tune(tmp_path, "m", *TINY, "batch_size=4", "tune.search=[optim]", "tune.numerics=allow",
                     "tune.options.optim=[muon]", *BARE, "tune.steps=1", "tune.repeats=1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert result["dimensions"] == {"optim": ["adamw", "muon"]}
    row = next(x for x in result["rows"] if x["candidate"] == "optim=muon")
    assert row["overrides"] == ["+optim=muon"]
    assert row["status"] in ("measured", "diverged") and row["loss_delta"] is not None  # its loss against the job's
    r, _ = tune(tmp_path, "k", *TINY, "batch_size=4", "tune.search=[optim]", "tune.options.optim=[muon]")
    assert r.returncode == 2 and "tune.options.optim: optim is searched only with tune.numerics=allow" in r.stderr

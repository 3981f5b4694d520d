"""DeepSpeed ZeRO 0-3 on the CPU (DeepSpeed's CPU accelerator, gloo): the same run as the local
engine, one optimizer step per window, save/load/continue, consolidated export. Skipped when
deepspeed is not installed (pip install 'looplib[deepspeed]')."""
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import dist_workers as W
from conftest import gpu, has_bitsandbytes, run_cli, tiny_gpt
from looplib.engines.local import write_safetensors
from looplib.errors import ConfigError
from looplib.precision import BF16, FP16, FP32

deepspeed = pytest.importorskip("deepspeed")

# ZeRO 1-3 keep fp32 master partitions, flatten gradients and clip from their own norm: losses
# agree with the local engine to float rounding (1e-6 relative); weights after 6 AdamW steps of
# lr 1e-2 to 1e-4 = 1% of one step (Adam magnifies rounding where a gradient is near zero).
LOSS_RTOL, WEIGHT_ATOL = 1e-6, 1e-4
STAGES = [0, 1, 2, 3]
# on two processes, the stages that partition across them (stage 1 is stage 2 less the gradients'
# partition; stage 0 is plain data parallelism): all four run on one process above
TWO_PROCESS_STAGES = [2, 3]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    losses, weights = W.local_reference(W.STEPS + W.MORE)
    path = tmp_path_factory.mktemp("local") / "model.safetensors"
    write_safetensors(tiny_gpt(), path)                     # what the local engine exports
    return losses, weights, sorted(load_file(path))


def check_against_reference(results, reference, stages=STAGES):
    losses, weights, local_keys = reference
    assert sorted(map(int, results)) == stages
    for stage in stages:
        r = results[str(stage)]
        assert r["losses"] == pytest.approx(losses[:W.STEPS], rel=LOSS_RTOL), stage
        assert r["continued"] == pytest.approx(losses[W.STEPS:], rel=LOSS_RTOL), stage
        assert r["resumed"] == r["continued"], stage                 # save, load, continue: exact
        assert r["resume_equals_continue"], stage
        assert r["optimizer_steps"] == r["boundaries"] == W.STEPS, stage   # backward() hides no step
        assert r["export_equals_live"], stage
        assert r["export_keys"] == local_keys, stage                 # tied head stored once, as locally
        assert set(r["export_keys"]) < set(r["live_keys"])
        for name, value in weights.items():
            torch.testing.assert_close(torch.tensor(r["continued_weights"][name]), value,
                                       atol=WEIGHT_ATOL, rtol=0, msg=f"stage {stage} {name}")


def test_zero_stages_one_process_match_the_local_engine(tmp_path, reference):
    W.spawn(W.deepspeed_worker, 1, tmp_path, STAGES)
    check_against_reference(json.loads((tmp_path / "deepspeed.json").read_text()), reference)


def test_zero_stages_two_processes_match_the_local_engine(tmp_path, reference):
    W.spawn(W.deepspeed_worker, 2, tmp_path, TWO_PROCESS_STAGES)
    check_against_reference(json.loads((tmp_path / "deepspeed.json").read_text()), reference, TWO_PROCESS_STAGES)


# ------------------------------------------------------------------ the derived config

def derive(precision=FP32(), max_grad_norm=1.0, **engine):
    from looplib.engines.deepspeed import DeepSpeed
    settings = SimpleNamespace(batch_size=4, accum_steps=8, max_grad_norm=max_grad_norm)
    return DeepSpeed("cpu", **engine).derive(settings, precision, world_size=2)


def test_the_config_is_derived_from_looplib_settings():
    cfg = derive(stage=3, offload_optimizer="nvme", offload_params="cpu", nvme_path="/nvme",
                 config={"zero_optimization": {"overlap_comm": True}, "wall_clock_breakdown": True})
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 8
    assert cfg["train_batch_size"] == 64 and cfg["gradient_clipping"] == 1.0
    assert cfg["managed_gradient_accumulation"] is False
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                                        "offload_param": {"device": "cpu"}, "overlap_comm": True}
    assert cfg["wall_clock_breakdown"] is True and "fp16" not in cfg and "bf16" not in cfg
    assert derive(max_grad_norm=None)["gradient_clipping"] == 0.0   # DeepSpeed's own default would be 1.0
    assert derive(BF16())["bf16"] == {"enabled": True}
    fp16 = FP16(init_scale=2.0**10, growth_interval=100)
    assert derive(fp16)["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 10,
                                    "loss_scale_window": 100, "hysteresis": 1, "min_loss_scale": 1}
    with pytest.raises(ConfigError, match="doubles and halves"):
        derive(FP16(growth_factor=3.0))


# ------------------------------------------------------------------ impossible combinations

QUICK = ["data=random", "max_steps=2", "batch_size=2", "eval_samples=4", "sample_tokens=0",
         "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16"]

BAD = [
    (["engine.stage=2", "engine.offload_params=cpu"], "engine.offload_params: parameter offload needs ZeRO stage 3"),
    (["+precision=fp16", "+engine.config.bf16.enabled=true"], "fp16 and bf16 are both enabled"),
    (["+engine.config.bf16.enabled=true"], "engine.config enables bf16 but the precision is fp32"),
    (["engine.stage=5"], "engine.stage: engine.stage=5 is not one of 0, 1, 2 or 3"),
    (["engine.offload_optimizer=nvme", "+optim=cpu_adam"], "engine.nvme_path: offload to nvme needs"),
    (["engine.offload_optimizer=disk"], "engine.offload_optimizer='disk' is not one of none, cpu or nvme"),
    (["engine.stage=0", "engine.offload_optimizer=cpu"], "optimizer offload needs ZeRO stage 1, 2 or 3"),
    (["engine.offload_optimizer=cpu"], "DeepSpeed expects its CPU Adam there"),
    (["+engine.config.gradient_clipping=0.5"], "engine.config.gradient_clipping: looplib derives this"),
    (["+engine.config.optimizer.type=Adam"], "engine.config.optimizer: looplib derives this"),
    (["+engine.config.zero_optimization.stage=3"], "set engine.stage"),
    (["+precision=fp16", "precision.growth_factor=4"], "doubles and halves"),
]
if has_bitsandbytes():
    BAD.append((["+optim=adam8bit", "engine.offload_optimizer=cpu"], "is an 8-bit GPU optimizer, but optimizer offload"))


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_impossible_combinations_exit_2_with_one_line(args, message, tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("+engine=deepspeed", *args, *QUICK, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("looplib: error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr and not run_dir.exists()


def test_cli_stage3_run_exports_what_the_local_engine_trains(tmp_path):
    common = [*QUICK, "max_steps=3", "accum_steps=2", "log_every=1", "sample_tokens=4"]
    r = run_cli(*common, f"hydra.run.dir={tmp_path / 'local'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli("+engine=deepspeed", "engine.stage=3", *common, f"hydra.run.dir={tmp_path / 'ds'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert '"managed_gradient_accumulation": false' in r.stdout and '"stage": 3' in r.stdout  # printed
    header = next(line for line in r.stdout.splitlines() if "] - training " in line)
    assert "training GPT (" in header and header.endswith("optimizer AdamW"), header  # not DeepSpeed's StepHooks
    a, b = load_file(tmp_path / "ds" / "model.safetensors"), load_file(tmp_path / "local" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=WEIGHT_ATOL, rtol=0)
    losses = [[json.loads(x)["loss"] for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
               if '"loss"' in x] for d in ("ds", "local")]
    assert losses[0] == pytest.approx(losses[1], rel=LOSS_RTOL)
    assert "a sample from the trained model" in r.stdout


@pytest.mark.parametrize("stage", [2, 3])
def test_cli_resume_through_deepspeeds_own_checkpoint(tmp_path, stage):
    """looplib's checkpoints under DeepSpeed: the engine writes its partitions, looplib its
    manifest (written last); resume=PATH continues exactly as the uninterrupted run."""
    common = [*QUICK, "+engine=deepspeed", f"engine.stage={stage}", "max_steps=4", "accum_steps=2",
              "log_every=1", "checkpoint.every_steps=2", "checkpoint.keep=3", "seed=3"]
    full = tmp_path / "full"
    r = run_cli(*common, f"hydra.run.dir={full}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    from looplib.store.checkpoint_dir import is_valid
    ckpts = sorted((full / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-00000002", "step-00000004"]  # no latest, zero_to_fp32.py: DeepSpeed's
    assert all(is_valid(c) is None for c in ckpts if c.is_dir())
    resumed = tmp_path / "resumed"
    r = run_cli(*common, f"resume={full / 'checkpoints' / 'step-00000002'}", f"hydra.run.dir={resumed}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = [{json.loads(x)["step"]: json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()
               if '"loss"' in x} for d in (full, resumed)]
    assert losses[1] == {3: losses[0][3], 4: losses[0][4]}


def test_deepspeed_launcher_two_processes_match_one(tmp_path):
    from looplib.process.launcher import free_port
    common = [*QUICK, "max_steps=3", "log_every=1"]
    r = run_cli(*common, "batch_size=4", f"hydra.run.dir={tmp_path / 'local'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # `deepspeed --num_gpus 2 --module looplib.train ...`; the launcher adds --local_rank=N
    r = run_cli("--num_gpus", "2", "--master_port", str(free_port()), "--module", "looplib.train",
                "+engine=deepspeed", *common, "batch_size=2", f"hydra.run.dir={tmp_path / 'ds'}",
                cwd=tmp_path, module="deepspeed.launcher.runner")
    assert r.returncode == 0, r.stderr[-3000:]
    assert '"train_batch_size": 4' in r.stdout                        # 2 per process x 2 processes
    a, b = load_file(tmp_path / "ds" / "model.safetensors"), load_file(tmp_path / "local" / "model.safetensors")
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=WEIGHT_ATOL, rtol=0)


@gpu
@pytest.mark.parametrize("engine", [["engine.stage=2", "engine.offload_optimizer=cpu"],
                                    ["engine.stage=3", "engine.offload_optimizer=cpu", "engine.offload_params=cpu"]],
                         ids=["zero2-offload", "zero3-offload"])
def test_cuda_offload_runs_and_tracks_the_local_engine(engine, tmp_path):
    """On a GPU: ZeRO-Offload with DeepSpeed's CPU Adam, bf16, against the local engine (AdamW, bf16)."""
    common = [*QUICK, "max_steps=4", "log_every=1", "device=cuda", "+precision=bf16", "batch_size=4"]
    r = run_cli(*common, f"hydra.run.dir={tmp_path / 'local'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli("+engine=deepspeed", *engine, "+optim=cpu_adam", *common, f"hydra.run.dir={tmp_path / 'ds'}",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [[json.loads(x)["loss"] for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
               if '"loss"' in x] for d in ("ds", "local")]
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)  # bf16 weights (DeepSpeed) vs bf16 autocast (local)
    assert (tmp_path / "ds" / "model.safetensors").stat().st_size > 0

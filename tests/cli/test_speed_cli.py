"""The speed options through the command line (the in-process tests: tests/unit/test_speed.py)."""
import json
import pytest
import torch
from looplib import ConfigError
from looplib.precision import FP8

from conftest import run_cli


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_fp8_is_refused_on_a_cpu_with_one_line(tmp_path, token_cache):
    with pytest.raises(ConfigError, match="fp8 needs a CUDA GPU of compute capability >= 8.9, not cpu"):
        FP8().setup(torch.device("cpu"))
    r = run_cli("+precision=fp8", "data=random", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "use +precision=bf16 on this device" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_chunked_loss_and_padded_vocab_through_the_cli(tmp_path, token_cache):
    """One run with both options: it trains, the padded rows are saved, compile_s is absent (eager)."""
    args = ["data=random", "data.vocab_size=100", "model.n_layer=1", "model.d_model=32", "model.seq_len=16",
            "batch_size=4", "max_steps=3", "log_every=1", "eval_every=0", "eval_samples=4", "sample_tokens=4",
            "loss=lm_chunked", "loss.chunk_size=20", "model.pad_vocab_to=64", "checkpoint.enabled=false"]
    r = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3] and "eval_loss" in rows[-2]
    assert rows[-2]["eval_s"] > 0 and set(rows[-1]) == {"step", "sample_s"}  # the sample's seconds close the rows
    assert not any("compile_s" in row for row in rows)
    from safetensors.torch import load_file
    assert load_file(tmp_path / "run" / "model.safetensors")["head.weight"].shape == (128, 32)  # tied: saved once


def test_cuda_graphs_with_accumulation_are_refused_before_anything_is_built(tmp_path, token_cache):
    """torch's CUDA graph trees lose the first micro-batch's gradients of a window (the GPU tests'
    error on an H200, 2026-11-28; PyTorch issue 169545): reduce-overhead with accum_steps > 1 is
    refused in one line, from the command line before any model or data is built."""
    from looplib.compile import TorchCompile
    with pytest.raises(ConfigError, match="cannot accumulate gradients over accum_steps=2") as err:
        TorchCompile(mode="reduce-overhead").check_accumulation(2)
    assert err.value.key == "compile.mode"
    TorchCompile(mode="reduce-overhead").check_accumulation(1)
    TorchCompile(mode="default").check_accumulation(4)
    r = run_cli("+compile=reduce_overhead", "accum_steps=2", "data=random", "max_steps=2",
                f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 2 and "compile.mode" in r.stderr and "accum_steps=2" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()

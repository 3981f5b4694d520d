"""Activation checkpointing through the command line (the in-process tests: tests/unit/test_activations.py)."""
import pytest

from conftest import run_cli


@pytest.mark.parametrize("args,message", [
    (["checkpointing.types=[Nope]"], "checkpointing: no submodule of GPT matches types=['Nope']"),
    (["checkpointing.every=0"], "checkpointing.every: checkpointing.every must be at least 1"),
    (["checkpointing.names='a['", "checkpointing.types=[]"], "checkpointing.names: 'a[' is not a regular expression"),
])
def test_cli_errors(args, message, tmp_path, token_cache):
    out = run_cli("+checkpointing=blocks", "data=random", "max_steps=1", *args, f"hydra.run.dir={tmp_path}/run",
                  cwd=tmp_path, env={"LOOPLIB_CACHE": token_cache})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"looplib: error: {message}"), out.stderr
    assert not (tmp_path / "run").exists()


def test_cli_trains_with_checkpointing(tmp_path, token_cache):
    out = run_cli("+checkpointing=blocks", "data=random", "max_steps=2", "eval_samples=4", "sample_tokens=0",
                  "batch_size=4", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, env={"LOOPLIB_CACHE": token_cache})
    assert out.returncode == 0, out.stderr
    assert "activation checkpointing: 4 of GPT's submodules (blocks.0" in out.stdout + out.stderr
    assert (tmp_path / "run" / "model.safetensors").exists()

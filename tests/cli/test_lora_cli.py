"""LoRA through the command line (the in-process tests: tests/unit/test_lora.py)."""
import json
import pytest
import torch
from looplib import GPT_LINEARS

from conftest import run_cli


peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'looplib[peft]')")


def test_lora_through_the_cli(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("+peft=lora", "peft.r=2", "+evaluation=bf16", "data=random", "max_steps=2", "batch_size=2",
                "log_every=1", "eval_samples=4", "sample_tokens=4", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "LoRA r=2 on attn.qkv,attn.proj,mlp.0,mlp.2" in r.stderr + (run_dir / "train.log").read_text()
    evals = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
    assert [e["step"] for e in evals] == [2]  # the end-of-run evaluation, with bf16 weights
    assert "looplib.evaluation.HalfWeights" in (run_dir / "config.yaml").read_text()
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 2 and set(config["target_modules"]) == set(GPT_LINEARS)  # the bundled GPT's defaults
    assert not (run_dir / "model.safetensors").exists()
    # peft loads the adapter onto the run's model, with the weights the run trained
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from safetensors.torch import load_file
    saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    loaded = peft.PeftModel.from_pretrained(instantiate(OmegaConf.load(run_dir / "config.yaml").model),
                                            str(run_dir / "adapter"))
    weights = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert weights.keys() == saved.keys() and all(torch.equal(weights[k], v) for k, v in saved.items())


def test_bad_target_modules_through_the_cli(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("+peft=lora", "peft.target_modules=[q_proj]", "data=random", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("looplib: error: peft.target_modules"), r.stderr
    assert not run_dir.exists()

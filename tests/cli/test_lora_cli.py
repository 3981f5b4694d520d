"""LoRA through the command line (the in-process tests: tests/unit/test_lora.py)."""
import json
import pytest
import torch
from looplib import GPT_LINEARS, ConfigError, LoRA, train_model

from conftest import random_tokens, run_cli, tiny_gpt


peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'looplib[peft]')")


def test_lora_through_the_cli(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("+peft=lora", "peft.r=2", "peft.allow_random_base=true", "+evaluation=bf16", "data=random", "max_steps=2", "batch_size=2",
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
    r = run_cli("+peft=lora", "peft.target_modules=[q_proj]", "peft.allow_random_base=true", "data=random", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("looplib: error: peft.target_modules"), r.stderr
    assert not run_dir.exists()


RUN = ["data=random", "data.n_train=16", "data.n_eval=4", "data.vocab_size=64", "model.seq_len=16", "batch_size=4",
       "sample_tokens=0", "eval_samples=4", "progress=lines"]
TINY = [*RUN, "model.n_layer=1", "model.d_model=32", "model.n_head=2"]


@pytest.mark.parametrize("args", [["+peft=lora"], ["+peft=lora", "model=llama_tiny", "model.hidden_size=32",
                                                   "model.intermediate_size=64", "model.num_hidden_layers=1",
                                                   "model.num_attention_heads=2", "model.num_key_value_heads=1"]])
def test_lora_on_a_model_never_trained_is_refused_unless_said(tmp_path, args):
    if "model=llama_tiny" in args:
        pytest.importorskip("transformers")
    r = run_cli(*(RUN if "model=llama_tiny" in args else TINY), *args, "max_steps=1", f"hydra.run.dir={tmp_path / 'run'}",
                cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("looplib: error: peft: +peft=lora on a ") and "never trained" in lines[0]
    assert "model.init_from=RUN_DIR" in lines[0] and "peft.allow_random_base=true" in lines[0]
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="never trained"):  # train_model: the same rule
        train_model(tiny_gpt(), random_tokens(), max_steps=1, batch_size=4, peft=LoRA(r=2), device="cpu")


def test_pretrain_then_fine_tune_with_init_from_and_lora(tmp_path):
    from safetensors.torch import load_file
    pre, ft = tmp_path / "pre", tmp_path / "ft"
    r = run_cli(*TINY, "max_steps=3", f"hydra.run.dir={pre}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli(*TINY, "max_steps=2", f"model.init_from={pre}", "+peft=lora", "peft.r=2", "seed=7",
                f"hydra.run.dir={ft}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    said = [line for line in (ft / "train.log").read_text().splitlines() if "model.init_from:" in line]
    assert len(said) == 1 and f"from {pre / 'model.safetensors'}" in said[0] and "weights only" in said[0]
    # the base the adapter trained on is the pretrained run's model, exactly (LoRA leaves it frozen)
    pretrained = load_file(pre / "model.safetensors")
    (step,) = (ft / "checkpoints").iterdir()
    tuned = load_file(step / "model.safetensors")
    base = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in tuned.items()
            if "lora_" not in k}
    assert pretrained.keys() <= base.keys() and all(torch.equal(base[k], v) for k, v in pretrained.items())
    assert (ft / "adapter" / "adapter_model.safetensors").is_file()
    assert f"init_from: {pre}" in (ft / "config.yaml").read_text()
    # train_model: the same weights, from a checkpoint directory too
    (pre_step,) = (pre / "checkpoints").iterdir()
    from looplib.store.init_from import init_from
    import looplib.models
    small = looplib.models.GPT(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)
    init_from(small, pre_step)
    assert all(torch.equal(small.state_dict()[k], v) for k, v in pretrained.items())
    # a model of another shape: one line naming both, nothing written
    r = run_cli(*TINY, "max_steps=1", f"model.init_from={pre}", "model.d_model=64", f"hydra.run.dir={tmp_path / 'x'}",
                cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("looplib: error: model.init_from: "), r.stderr
    assert "(16, 64) in the model but (16, 32) in" in lines[0] and str(pre) in lines[0]
    assert not (tmp_path / "x").exists()

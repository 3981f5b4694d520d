"""+peft=lora: only adapter weights train, the optimizer holds only them, and the saved
adapter (safetensors) loads into a fresh model with identical outputs."""

import pytest
import torch

from looplib import GPT_LINEARS, AdamW, ConfigError, FullModel, LoRA, load_lora, train_model
from looplib.store.export import write_exports

from conftest import random_tokens, tiny_gpt


def test_lora_trains_only_adapters_and_round_trips(tmp_path):
    base = {k: v.clone() for k, v in tiny_gpt().state_dict().items()}
    lora = LoRA(r=4, alpha=8, target_modules=GPT_LINEARS, allow_random_base=True)
    result = train_model(tiny_gpt(), random_tokens(), max_steps=3, batch_size=4, accum_steps=2, peft=lora,
                         optim=AdamW(lr=1e-2), device="cpu")
    model, opt = result.model, result.optimizer
    adapter = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    assert len(adapter) == 2 * 2 * len(GPT_LINEARS)  # A and B, per target, per block
    # the optimizer holds exactly the adapter weights, and state for them alone
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in adapter.values()} and len(held) == len(adapter)
    state_numel = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in opt.state.values())
    assert state_numel == 2 * sum(p.numel() for p in adapter.values())
    # the base weights did not move; the adapters did (lora_B starts at zero)
    merged_free = model.get_base_model().state_dict()
    for key, value in base.items():
        name = key.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        current = merged_free.get(key, merged_free.get(name))
        torch.testing.assert_close(current, value, rtol=0, atol=0)
    assert any(p.abs().sum() > 0 for n, p in adapter.items() if ".lora_B." in n)

    write_exports(model, tmp_path, lora.exports())
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert not (tmp_path / "model.safetensors").exists()
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in adapter.values())

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        trained_out = model(ids)
        loaded = load_lora(tiny_gpt(), tmp_path / "adapter").eval()
        torch.testing.assert_close(loaded(ids), trained_out, rtol=0, atol=0)
        assert not torch.allclose(tiny_gpt()(ids), trained_out)  # the adapter changes the outputs


@pytest.mark.parametrize("targets,problem", [(["attn.nope"], "no module of GPT is named 'attn.nope'"),
                                             (["mlp"], "'mlp' names blocks.0.mlp, a Sequential, which LoRA cannot adapt")])
def test_bad_target_modules_are_refused(targets, problem):
    with pytest.raises(ConfigError) as err:
        LoRA(target_modules=targets).wrap(tiny_gpt())
    assert err.value.key == "peft.target_modules" and problem in str(err.value)


def test_a_model_without_default_targets_asks_for_them():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with pytest.raises(ConfigError) as err:
        LoRA().wrap(model)
    assert err.value.key == "peft.target_modules" and "peft.target_modules=[0,2]" in str(err.value)


def test_the_null_adapter_saves_the_whole_model(tmp_path):
    model = tiny_gpt()
    assert FullModel().wrap(model) is model
    write_exports(model, tmp_path, FullModel().exports())
    from safetensors.torch import load_model
    fresh = tiny_gpt(seed=1)
    load_model(fresh, tmp_path / "model.safetensors")
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)

"""QLoRA in-process: refusals, missing packages, the CUDA path (the command-line tests: tests/cli/test_qlora.py)."""
from types import SimpleNamespace
import pytest
import torch
from looplib import AdamW, ConfigError, train_model
from looplib.precision import FP8, Precision
from looplib.quantize import is_4bit

from conftest import gpu, needs_bnb, random_tokens, tiny_gpt
from test_qlora import losses, qlora  # noqa: F401 - helpers and fixtures the tests share


pytestmark = needs_bnb


class Engine(SimpleNamespace):
    device = torch.device("cpu")


@pytest.mark.parametrize("case,key,words", [
    ("deepspeed", "peft", "+engine=deepspeed with +peft=qlora: ZeRO flattens parameters into its own partitions"),
    ("offload", "engine.offload", "engine.offload=cpu with +peft=qlora: FSDP's CPU offload of a 4-bit base is not "
                                  "supported"),
    ("fp8", "peft", "not under +precision=fp8"),
    ("no_linear", "peft", "has no linear layer to quantise"),
])
def test_what_cannot_work_is_refused_in_one_line(case, key, words):
    strategy = qlora()
    with pytest.raises(ConfigError) as err:
        if case == "deepspeed":
            strategy.check(Engine(keeps_modules=False, label="deepspeed"), Precision())
        elif case == "offload":  # FSDP shards a 4-bit base, but not into host memory
            strategy.check(Engine(keeps_modules=False, shards_4bit=True, offload="cpu", label="fsdp"), Precision())
        elif case == "fp8":
            strategy.check(Engine(keeps_modules=True), FP8.__new__(FP8))
        else:
            strategy.wrap(torch.nn.Sequential(torch.nn.Embedding(8, 4)))
    assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value)
    if case in ("deepspeed", "offload"):  # each names what works instead
        assert "use +engine=fsdp" in str(err.value) or "use engine.offload=none" in str(err.value)


@pytest.mark.gpu
@gpu
def test_on_cuda_qlora_quantises_on_the_device_and_trains_in_bf16(tmp_path):
    from looplib.precision import BF16
    result = train_model(tiny_gpt(), random_tokens(n=8), peft=qlora(), precision=BF16(), optim=AdamW(lr=2e-2),
                         max_steps=12, batch_size=4, device="cuda", log_every=1, metrics=tmp_path / "metrics.jsonl")
    trace = losses(tmp_path / "metrics.jsonl")
    assert trace[-1] < trace[0] - 0.1
    layers = [m for m in result.model.modules() if is_4bit(m)]
    assert layers and all(m.weight.is_cuda and m.weight.dtype == torch.uint8 and m.compute_dtype == torch.bfloat16
                          for m in layers)
    # the export's full-precision base is dequantised layer by layer into host memory (an 8B
    # base in fp32 would not fit on the device it trained on)
    from looplib.quantize import dequantized
    weights = {k: v.detach() for k, v in result.model.state_dict().items()}
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    full = dequantized(result.model, weights)
    assert all(full[f"{n}.weight"].device.type == "cpu" for n, m in result.model.named_modules() if is_4bit(m))
    largest = max(m.weight.numel() * 2 * 4 for m in layers)  # packed: 2 weights a byte; fp32 out
    assert torch.cuda.max_memory_allocated() - before <= 2 * largest


def test_missing_packages_are_named_together(monkeypatch):
    """Without peft and bitsandbytes, +peft=qlora names both and the one install that brings them."""
    import importlib.util
    from looplib.peft import QLoRA
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("peft", "bitsandbytes") else real(name, *a))
    with pytest.raises(ConfigError) as err:
        QLoRA()
    assert str(err.value) == ("peft: +peft=qlora needs peft and bitsandbytes, which are not installed; "
                              "pip install 'looplib[peft,bnb]', or use +peft=lora (needs peft only)")

"""A Hugging Face transformers model, built from a config (no download), trains through
looplib with bf16 autocast and 8-bit Adam; skipped when transformers is not installed."""

import pytest
import torch

from looplib import BF16, Adam8bit, ConfigError, RandomTokens, train_model

from conftest import needs_bnb

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'looplib[hf]')")

LLAMA = dict(model_type="llama", seq_len=16, vocab_size=64, max_position_embeddings=16, hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def tiny_llama(seed=0, **extra):
    from looplib.hf import CausalLM
    torch.manual_seed(seed)
    return CausalLM(**LLAMA, **extra)


def test_causal_lm_wrapper_matches_the_transformers_model():
    from looplib.hf import CausalLMLoss
    from looplib.loss import TokenCrossEntropy
    model = tiny_llama()
    assert isinstance(model.hf, transformers.LlamaForCausalLM)
    assert model.hf.config._attn_implementation == "sdpa"
    batch = RandomTokens(2, 16, 64)[0]
    batch = {k: v[None] for k, v in batch.items()}
    logits = model(batch["input_ids"])
    torch.testing.assert_close(logits, model.hf(input_ids=batch["input_ids"]).logits)
    # the objective for an unwrapped transformers model agrees with the usual one on the wrapper
    torch.testing.assert_close(CausalLMLoss()(model.hf, batch), TokenCrossEntropy()(model, batch))
    out = model.generate(batch["input_ids"][:, :4], 3, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 7)


@needs_bnb
def test_llama_trains_with_bf16_and_adam8bit_and_checkpointing():
    model = tiny_llama(gradient_checkpointing=True)
    assert getattr(model.hf, "is_activation_checkpointing", None) or model.hf.is_gradient_checkpointing
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = RandomTokens(16, 16, 64)
    result = train_model(model, data, max_steps=4, batch_size=4, accum_steps=2, precision=BF16(),
                         optim=Adam8bit(lr=1e-2, min_8bit_size=4096), eval_dataset=data, device="cpu")
    state_dtypes = {s["state1"].dtype for s in result.optimizer.state.values() if "state1" in s}
    assert torch.uint8 in state_dtypes                     # 8-bit state for the big matrices
    assert all(p.dtype == torch.float32 for p in model.parameters())   # bf16 is autocast, weights stay fp32
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
    assert result.eval_loss is not None and result.eval_loss < 4.2  # log(64) = 4.16 at the start


def test_an_unknown_model_type_is_a_config_error():
    from looplib.hf import CausalLM
    with pytest.raises(ConfigError) as err:
        CausalLM(model_type="no-such-architecture", seq_len=8)
    assert err.value.key == "model.model_type"

"""Batched sampling with a key/value cache (looplib.sampling, issue 41): token for token what the
uncached reference sampler draws, prompt by prompt, for the bundled GPT and a tiny transformers
Llama, with and without LoRA; greedy equal to transformers' own ``generate``."""
from __future__ import annotations

import pytest
import torch

from looplib.models import GPT
from looplib.sampling import sample, sample_groups

LLAMA = dict(model_type="llama", seq_len=48, vocab_size=64, max_position_embeddings=48, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
STOP, PAD = 5, 0


def gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(vocab_size=64, seq_len=48, n_layer=2, n_head=2, d_model=32)


def llama(seed=0):
    pytest.importorskip("transformers")
    from looplib.hf import CausalLM
    torch.manual_seed(seed)
    return CausalLM(**LLAMA)


def lora(model):
    pytest.importorskip("peft")
    from looplib.peft import LoRA
    wrapped = LoRA(r=4, alpha=8, allow_random_base=True).wrap(model)
    with torch.no_grad():  # B starts at zero: moved, so the adapters change what is sampled
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return wrapped


def sharpened(model):
    """The weights scaled up: a random tiny model's distribution is nearly flat, this one has favourites
    (some rows stop early, some run to the end: both paths are exercised)."""
    with torch.no_grad():
        torch.manual_seed(7)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def prompts(lengths=(3, 9, 1, 6, 4)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(6, 64, (n,), generator=g) for n in lengths]


def seeded(k):
    return [torch.Generator().manual_seed(1000 + i) for i in range(k)]


MODELS = {"gpt": lambda: sharpened(gpt()), "gpt+lora": lambda: lora(sharpened(gpt())),
          "llama": lambda: sharpened(llama()), "llama+lora": lambda: lora(sharpened(llama()))}


@pytest.mark.parametrize("name,top_p", [("gpt", 1.0), ("gpt", 0.9), ("gpt+lora", 0.9), ("llama", 1.0),
                                         ("llama", 0.9), ("llama+lora", 1.0)])
def test_cached_batched_sampling_equals_the_uncached_reference_token_for_token(name, top_p):
    model = MODELS[name]()
    ps = prompts()
    assert hasattr(model, "decoding_cache")  # (under peft's wrapper too)
    with torch.no_grad():
        want = [sample(model, p, 3, 14, 1.3, top_p, STOP, g) for p, g in zip(ps, seeded(len(ps)))]
        got = sample_groups(model, ps, 3, 14, 1.3, top_p, STOP, seeded(len(ps)), PAD)
    stopped = 0
    for w, g in zip(want, got):
        assert g.shape[0] == 3 and g.shape[1] >= w.shape[1]
        assert g[:, :w.shape[1]].tolist() == w.tolist()
        assert (g[:, w.shape[1]:] == STOP).all()  # a group done early: padded with the stop token
        stopped += int((w == STOP).any(1).sum())
    assert 0 < stopped < 15  # rows that stopped and rows that ran to the end
    # and a prompt's completions do not depend on the prompts beside it
    with torch.no_grad():
        alone = sample_groups(model, ps[1:2], 3, 14, 1.3, top_p, STOP, seeded(2)[1:], PAD)[0]
    assert alone.tolist() == got[1][:, :alone.shape[1]].tolist()


def test_a_model_without_a_cache_is_sampled_prompt_by_prompt():
    model = sharpened(gpt())

    class Plain(torch.nn.Module):  # a model of one's own: logits only
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, ids):
            return self.inner(ids)
    ps = prompts()
    with torch.no_grad():
        want = sample_groups(model, ps, 2, 6, 1.0, 1.0, None, seeded(len(ps)))
        got = sample_groups(Plain(), ps, 2, 6, 1.0, 1.0, None, seeded(len(ps)))
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


@pytest.mark.parametrize("adapted", [False, True])
def test_greedy_sampling_equals_transformers_generate(adapted):
    model = sharpened(llama())
    model = lora(model) if adapted else model
    hf = model.hf
    ps = prompts()
    with torch.no_grad():
        got = sample_groups(model, ps, 1, 12, temperature=0.0, stop=None, pad=PAD)
        width = max(len(p) for p in ps)
        ids = torch.stack([torch.cat([torch.full((width - len(p),), PAD), p]) for p in ps])
        mask = torch.stack([torch.arange(width) >= width - len(p) for p in ps]).long()
        theirs = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, pad_token_id=PAD, eos_token_id=None)[:, width:]
    assert [g[0].tolist() for g in got] == theirs.tolist()
    assert len({tuple(r) for r in theirs.tolist()}) > 1


def test_the_gpt_training_forward_is_what_the_cache_reads_position_by_position():
    model = sharpened(gpt())
    ids = torch.randint(6, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        cache = model.decoding_cache(torch.ones(2, 10, dtype=torch.bool))
        parts = [model(ids[:, :4], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat([p[:, -1:] for p in parts], 1), full[:, 3:], rtol=1e-5, atol=1e-5)
    assert cache.length == 10

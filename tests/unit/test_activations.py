"""Activation checkpointing: same gradients, fewer saved tensors, composes with every strategy."""
import copy

import pytest
import torch

from looplib import optim as lo
from looplib.accumulation import Accumulation
from looplib.activations import ActivationCheckpointing, Checkpointing, is_checkpointed
from looplib.data import build_loader
from looplib.errors import ConfigError
from looplib.loop import fit
from looplib.models import BertClassifier
from looplib.loss import SequenceCrossEntropy, TokenCrossEntropy
from looplib.precision import BF16, FP16, Precision

from conftest import has_bitsandbytes, random_tokens, tiny_gpt

BLOCKS = ActivationCheckpointing(types=["Block", "GPT2Block", "BertLayer"])


def grads_and_saved(model, loss_fn):
    """Gradients of one backward, and how many tensors autograd saved for it."""
    saved = []

    def pack(t):
        saved.append(t.shape)
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(saved)


def lm_loss(batch):
    return lambda model: TokenCrossEntropy()(model, batch)


def assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_bundled_gpt_same_gradients_fewer_saved_tensors():
    batch = next(iter(build_loader(random_tokens(), batch_size=4, seed=0)))
    plain, ckpt = tiny_gpt(), tiny_gpt()
    BLOCKS.apply(ckpt)
    assert [n for n, m in ckpt.named_modules() if is_checkpointed(m)] == ["blocks.0", "blocks.1"]
    g_plain, n_plain = grads_and_saved(plain, lm_loss(batch))
    g_ckpt, n_ckpt = grads_and_saved(ckpt, lm_loss(batch))
    assert_same_grads(g_plain, g_ckpt)
    assert n_ckpt < n_plain / 2, (n_ckpt, n_plain)
    assert plain.state_dict().keys() == ckpt.state_dict().keys()  # safetensors / resume unchanged


def test_bert_classifier_with_padding_mask():
    torch.manual_seed(0)
    plain = BertClassifier(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32, dropout=0.0)
    ckpt = copy.deepcopy(plain)
    ActivationCheckpointing(names=r"blocks\.\d+", every=2).apply(ckpt)
    assert [n for n, m in ckpt.named_modules() if is_checkpointed(m)] == ["blocks.0", "blocks.2"]
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 12:] = 0
    batch = {"input_ids": torch.randint(0, 64, (4, 16)), "labels": torch.tensor([0, 1, 1, 0]),
             "attention_mask": mask}
    loss = lambda m: SequenceCrossEntropy()(m, batch)  # noqa: E731
    g_plain, n_plain = grads_and_saved(plain, loss)
    g_ckpt, n_ckpt = grads_and_saved(ckpt, loss)
    assert_same_grads(g_plain, g_ckpt)
    assert n_ckpt < n_plain


def test_a_transformers_model_built_from_a_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    ckpt = copy.deepcopy(plain)
    BLOCKS.apply(ckpt)
    assert sum(is_checkpointed(m) for m in ckpt.modules()) == 2
    ids = torch.randint(0, 64, (3, 16))
    loss = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    g_plain, n_plain = grads_and_saved(plain, loss)
    g_ckpt, n_ckpt = grads_and_saved(ckpt, loss)
    assert_same_grads(g_plain, g_ckpt)
    assert n_ckpt < n_plain


def test_no_grad_forward_and_deepcopy():
    model = tiny_gpt()
    BLOCKS.apply(model)
    ids = torch.randint(0, 64, (2, 16))
    with torch.inference_mode():
        out = model(ids)
    twin = copy.deepcopy(model)  # e.g. an EMA copy: it must run its own weights
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        assert not torch.equal(twin(ids), out)
        assert torch.equal(model(ids), out)
    assert all(is_checkpointed(b) for b in twin.blocks)
    assert Checkpointing().apply(model) is model


PRECISIONS = {"fp32": Precision, "bf16": BF16, "fp16": FP16}
OPTIMIZERS = {"adamw": lambda: lo.AdamW(lr=1e-2, weight_decay=0.1), "sgd": lambda: lo.SGD(lr=0.1),
              "adafactor": lambda: lo.Adafactor(lr=1e-2), "adam8bit": lambda: lo.Adam8bit(lr=1e-2)}


COMBINATIONS = [(p, o, 2) for p in PRECISIONS for o in OPTIMIZERS] + [("fp32", "adamw", 1)]


@pytest.mark.parametrize("precision,optim,accum", COMBINATIONS)
def test_composes_with_every_precision_optimizer_and_accumulation(precision, optim, accum):
    if optim == "adam8bit" and not has_bitsandbytes():
        pytest.skip("bitsandbytes is not installed")
    results = []
    for strategy in (Checkpointing(), BLOCKS):
        model = strategy.apply(tiny_gpt(seed=1))
        prec = PRECISIONS[precision]()
        prec.setup(torch.device("cpu"))
        loader = build_loader(random_tokens(n=16), batch_size=4 // accum, seed=0)
        fit(model, loader, objective=TokenCrossEntropy(), optimizer=OPTIMIZERS[optim]().build(model),
            precision=prec, accumulation=Accumulation(accum), max_steps=3, max_grad_norm=1.0)
        results.append(model.state_dict())
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=0, atol=0, msg=name)


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="checkpointing.types"):
        ActivationCheckpointing()
    with pytest.raises(ConfigError, match="every must be at least 1"):
        ActivationCheckpointing(types=["Block"], every=0)
    with pytest.raises(ConfigError, match="choose among its module classes: .*Block"):
        ActivationCheckpointing(types=["GPT2Block"]).apply(tiny_gpt())

"""Parameter groups, the optimizer registry, 8-bit state, schedules."""

import pytest
import torch
from torch import nn

from looplib import optim as lo
from looplib.schedule import Constant, WarmupCosine

from conftest import tiny_gpt


class MyNorm(nn.Module):  # a third-party norm that does not subclass torch's
    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.scale


def names(model, group):
    ids = {id(p) for p in group["params"]}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_param_groups_decay_only_weights():
    model = tiny_gpt()
    decay, no_decay = lo.param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert names(model, decay) == sorted(
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2"))
    nd = names(model, no_decay)
    assert "tok_emb.weight" in nd and "pos_emb.weight" in nd and "ln_f.weight" in nd
    assert "blocks.0.attn.qkv.bias" in nd and "blocks.1.ln2.bias" in nd
    # the tied head shares the embedding matrix: it appears once, without decay
    n_params = sum(1 for _ in model.parameters())
    assert len(decay["params"]) + len(no_decay["params"]) == n_params


def test_param_groups_recognise_norms_by_module_type():
    model = nn.Sequential(nn.Linear(4, 4), MyNorm(4), nn.BatchNorm1d(4), nn.Linear(4, 2, bias=False))
    decay, no_decay = lo.param_groups(model, 0.01)
    assert names(model, decay) == ["0.weight", "3.weight"]
    assert names(model, no_decay) == ["0.bias", "1.scale", "2.bias", "2.weight"]


def test_frozen_parameters_are_left_out():
    model = tiny_gpt()
    model.tok_emb.weight.requires_grad_(False)
    groups = lo.param_groups(model, 0.1)
    assert all(p.requires_grad for g in groups for p in g["params"])


def test_adam8bit_state_is_uint8_for_large_tensors_only():
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(512, 64), "big": nn.Linear(128, 64), "small": nn.Linear(16, 8)})
    opt = lo.Adam8bit(lr=1e-3, weight_decay=0.1).build(model)
    x = model["emb"](torch.arange(8))
    (model["big"](torch.cat([x, x], -1)).sum() + model["small"](torch.ones(16)).sum()).backward()
    opt.step()
    state = opt.state
    assert model["big"].weight.numel() >= 4096
    assert state[model["big"].weight]["state1"].dtype == torch.uint8
    assert state[model["big"].weight]["state2"].dtype == torch.uint8
    for small in (model["big"].bias, model["small"].weight, model["small"].bias):
        assert small.numel() < 4096 and state[small]["state1"].dtype == torch.float32
    assert model["emb"].weight.numel() >= 4096  # large, yet 32-bit: it is an embedding
    assert state[model["emb"].weight]["state1"].dtype == torch.float32


def test_adam8bit_without_embedding_override_quantises_embeddings():
    pytest.importorskip("bitsandbytes")
    model = nn.Embedding(512, 64)
    opt = lo.Adam8bit(lr=1e-3, embeddings_32bit=False).build(model)
    model(torch.arange(4)).sum().backward()
    opt.step()
    assert opt.state[model.weight]["state1"].dtype == torch.uint8


def test_adamw_impl_choice():
    model = tiny_gpt()
    assert lo.AdamW(lr=1e-3, impl="foreach").build(model).defaults["foreach"] is True
    assert lo.AdamW(lr=1e-3, impl="fused").build(model).defaults["fused"] is True
    assert lo.AdamW(lr=1e-3).build(model).defaults["foreach"] is True  # auto on the CPU


def test_warmup_cosine_schedule():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupCosine(warmup_steps=4, min_ratio=0.1).build(opt, total_steps=14)
    lrs = []
    for _ in range(14):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_constant_schedule():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.3)
    sched = Constant().build(opt, total_steps=5)
    for _ in range(5):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.3

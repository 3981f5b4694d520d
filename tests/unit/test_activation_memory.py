"""+checkpointing=offload and +checkpointing=selective: the same losses as none, and the memory
the planner says each activation strategy holds, against an exact count on the CPU.

The exact count: every storage made during a real forward that is still alive when it ends (what
autograd, checkpointing's recomputation and selective checkpointing's cache hold for backward;
each storage once, parameters left out; weak references, so counting keeps
nothing alive), on the device or, for offload, in host memory (the strategy's own copies). For
no checkpointing it equals the saved_tensors_hooks tally of tests/cli/test_plan.py (checked here)."""
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from looplib import AdamW
from looplib.accumulation import Accumulation
from looplib.activations import ActivationCheckpointing, Checkpointing, OffloadActivations, SelectiveCheckpointing
from looplib.data import build_loader
from looplib.engines import Engine
from looplib.loop import fit
from looplib.loss import TokenCrossEntropy
from looplib.models import GPT
from looplib.plan import activation_uses, chosen_modules

from conftest import gpu, random_tokens, tiny_gpt

BLOCKS = ["Block", "GradientCheckpointingLayer"]
STRATEGIES = {"none": Checkpointing, "blocks": lambda: ActivationCheckpointing(types=BLOCKS),
              "selective": lambda: SelectiveCheckpointing(types=BLOCKS),
              "offload": lambda: OffloadActivations(types=BLOCKS)}


class Made(TorchDispatchMode):
    """Weak references to every storage an op makes."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t.untyped_storage()) for t in tree_leaves(out) if torch.is_tensor(t)]
        return out


def held_after_forward(model, batch, strategy) -> tuple[int, int]:
    """(device, host) bytes held from the end of a real forward into backward, counted exactly."""
    keep = {p.untyped_storage().data_ptr() for p in model.parameters()}
    made = Made()
    with made:  # the batch copied in: held only where autograd saves it (the embedding's indices)
        loss = TokenCrossEntropy()(model, {k: v.clone() for k, v in batch.items()})
    gc.collect()
    alive = {s.data_ptr(): s.nbytes() for s in (r() for r in made.refs) if s is not None and s.nbytes()}
    host = {s.data_ptr() for s in getattr(strategy, "host", ())}
    device = sum(n for ptr, n in alive.items() if ptr not in keep | host | {loss.untyped_storage().data_ptr()})
    return device, sum(alive.get(ptr, 0) for ptr in host)


def hooks_tally(model, batch) -> int:
    """The bytes autograd saves for backward, each storage once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        TokenCrossEntropy()(model, batch)
    return sum(seen.values())


def planned(make, strategy, seq_len: int, micro: int):
    with torch.device("meta"):
        meta = make()
    chosen, keep, kind = chosen_modules(meta, strategy)
    use = activation_uses(meta, TokenCrossEntropy(), seq_len, None, chosen, keep)[kind]
    return use.device.at(micro), use.host.at(micro)


def gpt():
    torch.manual_seed(0)
    return GPT(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=32)


def llama(path):
    def make():  # on the meta device (the planner) built from its config.json, no weights read
        from looplib.hf import CausalLM
        torch.manual_seed(0)
        return CausalLM(seq_len=32, path=str(path))
    return make


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_the_planner_is_within_5_percent_of_the_exact_count_for_each_strategy(kind, request):
    make = gpt if kind == "gpt" else llama(request.getfixturevalue("tiny_pretrained"))
    micro, vocab = 3, 256 if kind == "gpt" else 384
    ids = torch.randint(0, vocab, (micro, 33), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()}
    counted = {}
    for name, strategy_of in STRATEGIES.items():
        strategy = strategy_of()
        model = strategy.apply(make())
        counted[name] = held_after_forward(model, batch, strategy)
        plan = planned(make, strategy, 32, micro)
        for what, real, estimate in zip(("device", "host"), counted[name], plan):
            assert estimate == pytest.approx(real, rel=0.05, abs=64), (kind, name, what, estimate, real)
    assert counted["none"][0] == hooks_tally(make(), batch)  # the count is autograd's own for no checkpointing
    device = {name: c[0] for name, c in counted.items()}
    assert device["blocks"] < device["selective"] < device["none"]
    # offload: everything the blocks save is in host memory, nothing of it on the device; what is saved
    # outside them (the embeddings' indices, the final norm, the logits: much of a 2-layer toy) stays
    assert device["offload"] < device["blocks"] and counted["offload"][1] > 0.5 * device["none"]
    assert device["offload"] + counted["offload"][1] == pytest.approx(device["none"], rel=0.05)
    assert counted["none"][1] == counted["selective"][1] == 0


def five_steps(strategy, device: str = "cpu"):
    """Per micro-batch losses and the final weights of 5 fp32 steps (accumulation 2)."""
    model, objective, losses = strategy.apply(tiny_gpt(seed=1)).to(device), TokenCrossEntropy(), []

    def recording(m, batch):
        loss = objective(m, batch)
        losses.append(loss.item())
        return loss
    recording.count = objective.count
    fit(model, build_loader(random_tokens(n=16), batch_size=2, seed=0), objective=recording, max_steps=5,
        optimizer=AdamW(lr=1e-2).build(model), accumulation=Accumulation(2), max_grad_norm=1.0,
        engine=Engine(device))
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


def test_offload_and_selective_train_as_none_does_in_fp32():
    losses, weights = five_steps(Checkpointing())
    assert len(losses) == 10 and losses[-1] < losses[0]
    for name in ("offload", "selective"):
        strategy = STRATEGIES[name]()
        got, got_weights = five_steps(strategy)
        assert got == pytest.approx(losses, abs=1e-6), name
        for key, value in weights.items():
            torch.testing.assert_close(got_weights[key], value, rtol=0, atol=1e-6, msg=key)
        assert name != "offload" or strategy.host_bytes() == 0  # the host copies go with the graph


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_on_cuda_offload_trains_as_none_does_and_holds_less_on_the_device(overlap):
    losses, weights = five_steps(Checkpointing(), "cuda")
    got, got_weights = five_steps(OffloadActivations(types=BLOCKS, overlap=overlap), "cuda")
    assert got == pytest.approx(losses, abs=1e-5)
    for key, value in weights.items():
        torch.testing.assert_close(got_weights[key], value, rtol=1e-5, atol=1e-5, msg=key)
    held = {}
    for name in ("none", "offload"):
        strategy = STRATEGIES[name]() if name == "none" else OffloadActivations(types=BLOCKS, overlap=overlap)
        model = strategy.apply(GPT(vocab_size=256, seq_len=256, n_layer=4, n_head=4, d_model=256)).cuda()
        ids = torch.randint(0, 256, (8, 256), device="cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = TokenCrossEntropy()(model, {"input_ids": ids, "labels": ids})
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
    print(f"\nheld after forward: none {held['none'] / 2**20:.1f} MiB, offload {held['offload'] / 2**20:.1f} MiB")
    assert held["offload"] < 0.5 * held["none"]

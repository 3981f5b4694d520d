"""The planner in-process: static bytes equal the real tensors' bytes, ZeRO follows the paper, activations match what autograd saves (the command-line tests: tests/cli/test_plan.py)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from looplib import optim as lo
from looplib.models import GPT, BertClassifier
from looplib.loss import SequenceCrossEntropy, TokenCrossEntropy
from looplib.plan import (Checkpointing, activation_estimates, autocast_copy_bytes, gradient_bytes, optimizer_state_bytes_of, weight_bytes, zero_per_rank)
from looplib.precision import BF16, FP16, Precision

from conftest import has_bitsandbytes
from test_plan import real_state_bytes  # noqa: F401 - helpers and fixtures the tests share


def make_gpt():
    # vocab x width = 8192 elements: the embedding is big enough for 8-bit state (and kept
    # 32-bit by the embedding rule); attention projections (3072) are under 4096, MLP (4096) not
    return GPT(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=32)


def make_bert():
    return BertClassifier(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=32, dropout=0.0)


OPTIMIZERS = {"adamw": lambda: lo.AdamW(lr=1e-3, weight_decay=0.1), "sgd": lambda: lo.SGD(lr=0.1),
              "adafactor": lambda: lo.Adafactor(lr=1e-3), "adam8bit": lambda: lo.Adam8bit(lr=1e-3)}


PRECISIONS = {"fp32": Precision, "bf16": BF16, "fp16": lambda: FP16(init_scale=16.0)}  # no skipped first step


class ParameterCasts(TorchDispatchMode):
    """Records the copies autocast makes of parameters (aten._to_copy of a parameter)."""

    def __init__(self, params):
        super().__init__()
        self.params, self.copies = {p.data_ptr() for p in params}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.params:
            self.copies[args[0].data_ptr()] = out.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_static_bytes_equal_real_tensor_bytes(precision, optim):
    if optim == "adam8bit" and not has_bitsandbytes():
        pytest.skip("bitsandbytes is not installed")
    factory = OPTIMIZERS[optim]()
    prec = PRECISIONS[precision]()
    prec.setup(torch.device("cpu"))
    with torch.device("meta"):
        planned_model = make_gpt()
    planned = {"weights": weight_bytes(planned_model), "grads": gradient_bytes(planned_model),
               "copies": autocast_copy_bytes(planned_model, getattr(prec, "dtype", None)),
               "state": optimizer_state_bytes_of(factory, planned_model)}

    torch.manual_seed(0)
    model = make_gpt()
    opt = factory.build(model)
    casts = ParameterCasts(model.parameters())
    batch = {"input_ids": torch.randint(0, 256, (2, 32)), "labels": torch.randint(0, 256, (2, 32))}
    with prec.autocast(), casts:
        loss = TokenCrossEntropy()(model, batch)
    prec.backward(loss)
    prec.step(opt)
    real = {"weights": sum(p.untyped_storage().nbytes() for p in model.parameters()),
            "grads": sum(p.grad.untyped_storage().nbytes() for p in model.parameters()),
            "copies": sum(casts.copies.values()), "state": real_state_bytes(opt)}
    assert planned == real
    assert real["state"] > 0 and (real["copies"] > 0) == (precision != "fp32")


def test_per_param_figures_of_the_guides():
    """4 bytes/param fp32 weights, about 6 mixed; AdamW 8, SGD momentum 4, 8-bit Adam about 2."""
    with torch.device("meta"):
        model = BertClassifier(vocab_size=512, seq_len=64, n_layer=4, n_head=4, d_model=256)
    n = sum(p.numel() for p in model.parameters())
    assert weight_bytes(model) == 4 * n
    assert 1.8 < autocast_copy_bytes(model, torch.bfloat16) / n <= 2  # embeddings are not cast
    assert optimizer_state_bytes_of(lo.AdamW(lr=1), model) == 8 * n + 4 * len(list(model.parameters()))
    assert optimizer_state_bytes_of(lo.SGD(lr=1), model) == 4 * n
    assert 4 * len(list(model.parameters())) < optimizer_state_bytes_of(lo.Adafactor(lr=1), model) < 0.1 * n


def test_zero_arithmetic_follows_the_paper():
    """ZeRO paper (Rajbhandari et al. 2020), mixed-precision Adam: 2 bytes of fp16 parameters,
    2 of fp16 gradients, K = 12 of fp32 master weights, momentum and variance per parameter.
    Per rank over N ranks: baseline (2 + 2 + K) psi; P_os 2 psi + 2 psi + K psi / N;
    P_os+g 2 psi + (2 + K) psi / N; P_os+g+p (2 + 2 + K) psi / N."""
    psi, n, k = 7_500_000_000, 64, 12
    p, g, o = 2 * psi, 2 * psi, k * psi
    assert zero_per_rank(p, g, o, n, 0) == (2 + 2 + k) * psi
    assert zero_per_rank(p, g, o, n, 1) == 2 * psi + 2 * psi + k * psi // n
    assert zero_per_rank(p, g, o, n, 2) == 2 * psi + (2 + k) * psi // n
    assert zero_per_rank(p, g, o, n, 3) == (2 + 2 + k) * psi // n
    # the paper's Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB for a 7.5B model on 64 GPUs
    assert [round(zero_per_rank(p, g, o, n, s) / 1e9, 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    # offload: the optimizer state (ZeRO-Offload) and with stage 3 the parameters leave the device
    assert zero_per_rank(p, g, o, n, 2, offload_optimizer=True) == 2 * psi + 2 * psi // n
    assert zero_per_rank(p, g, o, n, 3, offload_optimizer=True, offload_params=True) == 2 * psi // n
    assert zero_per_rank(7, 7, 7, 2, 3) == 12  # a rank holds the ceiling of its share


def saved_bytes(model, objective, batch):
    """Bytes autograd really saves for backward (each storage once, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen and key not in params:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        objective(model, batch)
    return total[0]


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_activation_estimate_matches_what_autograd_saves_in_fp32(kind):
    make, objective = (make_gpt, TokenCrossEntropy()) if kind == "gpt" else (make_bert, SequenceCrossEntropy())
    with torch.device("meta"):
        meta = make()
    plain, ckpt, chosen = activation_estimates(meta, objective, 32, None, Checkpointing())
    assert chosen == ["blocks.0", "blocks.1"]
    model = make()
    for b in (1, 3):
        labels = torch.randint(0, 256, (b, 32)) if kind == "gpt" else torch.randint(0, 2, (b,))
        assert plain.device.at(b) == saved_bytes(model, objective, {"input_ids": torch.randint(0, 256, (b, 32)),
                                                             "labels": labels})
    assert ckpt.per_sample < plain.per_sample


def test_activation_estimate_under_bf16_is_close_to_cpu_autocast():
    with torch.device("meta"):
        meta = make_gpt()
    plain = activation_estimates(meta, TokenCrossEntropy(), 32, torch.bfloat16, Checkpointing())[0]
    model = make_gpt()
    batch = {"input_ids": torch.randint(0, 256, (4, 32)), "labels": torch.randint(0, 256, (4, 32))}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = saved_bytes(model, TokenCrossEntropy(), batch)
    weight_copies = autocast_copy_bytes(model, torch.bfloat16)  # saved too, but counted as static
    assert plain.device.at(4) == pytest.approx(real - weight_copies, rel=0.1)


class Made(TorchDispatchMode):
    """Bytes of the outputs of the aten ops named ``ops`` (by overload packet name)."""

    def __init__(self, *ops):
        super().__init__()
        self.ops, self.bytes = ops, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.ops:
            self.bytes[name] = self.bytes.get(name, 0) + out.untyped_storage().nbytes()
        return out


def test_the_loss_backward_is_planned_as_the_real_backward_allocates_it():
    """A language model's step peaks at the start of backward: nll_loss's backward makes an fp32
    gradient the size of the logits while everything saved is held, and log-softmax's backward
    another (fp32 under bf16 autocast: the loss upcasts). The plan's transient is those bytes."""
    vocab, seq, micro = 4096, 16, 2

    def make():
        return GPT(vocab_size=vocab, seq_len=seq, n_layer=1, n_head=2, d_model=16)
    with torch.device("meta"):
        meta = make()
    plain = activation_estimates(meta, TokenCrossEntropy(), seq, torch.bfloat16, Checkpointing())[0]
    ids = torch.randint(0, vocab, (micro, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = TokenCrossEntropy()(make(), {"input_ids": ids, "labels": ids.roll(-1, 1)})
    made = Made("nll_loss_backward", "_log_softmax_backward_data")
    with made:
        loss.backward()
    logits_fp32 = micro * seq * vocab * 4
    assert made.bytes == {"nll_loss_backward": logits_fp32, "_log_softmax_backward_data": logits_fp32}
    assert plain.transient.at(micro) == sum(made.bytes.values())
    assert plain.transient.per_sample == 2 * seq * vocab * 4 and plain.transient.fixed == 0

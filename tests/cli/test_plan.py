"""The memory planner: static bytes equal the real tensors' bytes, ZeRO follows the paper,
activations match what autograd really saves on the CPU, recommendations follow the guides."""
import pytest
import torch
from hydra import compose, initialize_config_module
from torch.utils._python_dispatch import TorchDispatchMode

from looplib import optim as lo
from looplib.models import GPT, BertClassifier
from looplib.loss import SequenceCrossEntropy, TokenCrossEntropy
from looplib.cli.plan import build_plan
from looplib.plan import (Checkpointing, activation_estimates, autocast_copy_bytes, default_checkpointing, gradient_bytes,
                          optimizer_state_bytes_of, recommendations, weight_bytes, zero_per_rank)
from looplib.precision import BF16, FP16, Precision

from conftest import has_bitsandbytes, run_cli


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


def real_state_bytes(opt):
    seen, total = set(), 0
    for state in opt.state.values():
        for t in state.values():
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


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


def test_the_peak_of_a_checkpointed_bf16_lm_is_the_loss_backward_without_the_blocks_copies():
    """Under +checkpointing=blocks the blocks' 16-bit weight copies live to the end of forward
    (autocast's cache) but not into backward; offload packs them to host memory."""
    over = ("data=random", "data.vocab_size=4096", "model.seq_len=64", "batch_size=8", "+precision=bf16")
    blocks = build_plan(compose_with(*over, "+checkpointing=blocks"), memory=2**30)
    with torch.device("meta"):
        model = GPT(vocab_size=4096, seq_len=64, n_layer=4, n_head=4, d_model=128)
    linears = [m for b in model.blocks for m in b.modules() if isinstance(m, torch.nn.Linear)]
    in_blocks = sum(2 * p.numel() for m in linears for p in m.parameters())
    assert blocks.copies_freed == in_blocks and blocks.copies == in_blocks + 2 * 4096 * 128  # the tied head stays
    use = blocks.activations
    assert use.transient.at(8) == 2 * 8 * 64 * 4096 * 4 > use.device.at(8)  # the loss's, more than all saved
    assert blocks.peak(8) == (blocks.weights + blocks.optim_state + blocks.copies - in_blocks + use.device.at(8)
                              + use.transient.at(8))
    assert blocks.uses["offload"].host.fixed == in_blocks  # the copies, packed once per forward


def compose_with(*overrides):
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_recommendations_follow_the_guides_order():
    cfg = compose_with("model=bert_tiny", "data=classification", "loss=classification", "batch_size=4")
    roomy = build_plan(cfg.copy(), memory=2**30)
    recs = recommendations(roomy)
    assert recs[0].startswith("largest micro-batch that fits at any accumulation: ")
    assert "batch_size=4 accum_steps=1" in recs[0]
    assert not any("ZeRO" in r or "checkpointing" in r for r in recs)
    fits = int(recs[0].split(": ")[1].split()[0].rstrip(";"))
    assert fits % 8 == 0 and fits >= 8
    static = roomy.static
    tight = build_plan(cfg.copy(), memory=int((static + roomy.act_plain.at(1) // 2) / 0.9))
    recs = recommendations(tight)
    assert recs[0].startswith("not even a micro-batch of 1 fits")
    order = [next(i for i, r in enumerate(recs) if r.startswith(s)) for s in
             ("+checkpointing=blocks", "+optim=adam8bit", "+precision=bf16")]
    assert order == sorted(order) and not any("ZeRO" in r for r in recs)
    tiny = build_plan(cfg.copy(), memory=static // 2, world=8)
    assert "ZeRO" in recommendations(tiny)[-1] and "8 rank(s)" in recommendations(tiny)[-1]


def test_the_peak_counts_gradients_beside_activations_only_when_accumulating():
    """The loop frees gradients after each update: without accumulation the forward pass ends
    with none allocated, with accumulation they live through the next micro-batches."""
    base = ("model=bert_tiny", "data=classification", "loss=classification", "batch_size=32")
    one = build_plan(compose_with(*base), memory=2**30)
    two = build_plan(compose_with(*base, "accum_steps=2"), memory=2**30)
    held = one.weights + one.copies + one.optim_state
    assert one.activations.at(32) > one.gradients  # activations dominate at this batch
    assert one.peak(32) == held + one.activations.at(32) < one.static + one.activations.at(32)
    assert two.peak(32) == two.static + two.activations.at(32)
    assert one.peak(1) == held + max(one.gradients, one.activations.at(1))


def test_checkpointed_estimate_uses_the_configured_strategy():
    cfg = compose_with("model=bert_tiny", "data=classification", "loss=classification",
                       "+checkpointing=blocks", "checkpointing.every=2")
    plan = build_plan(cfg, memory=2**30)
    assert plan.checkpointing_on and plan.chosen == ["blocks.0"]
    every_block = build_plan(compose_with("model=bert_tiny", "data=classification", "loss=classification"),
                             memory=2**30)
    assert not every_block.checkpointing_on and every_block.chosen == ["blocks.0", "blocks.1"]
    assert every_block.act_ckpt.per_sample < plan.act_ckpt.per_sample  # fewer modules, less saved
    assert plan.act_plain == every_block.act_plain and default_checkpointing().every == 1


def test_cli_prints_the_anatomy(tmp_path):
    out = run_cli("data=random", "+optim=sgd", "--world-size", "4", "--memory-gib", "16", cwd=tmp_path,
                  module="looplib.plan")
    assert out.returncode == 0, out.stderr
    with torch.device("meta"):
        model = GPT(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=128)
    n = sum(p.numel() for p in model.parameters())
    for line in ("weights (4 bytes/param)", "gradients", "optimizer state (SGD)"):
        assert any(row.strip().startswith(line) and f"{4 * n:,} B" in row for row in out.stdout.splitlines()), line
    assert "4 rank(s)" in out.stdout and "device memory (given)" in out.stdout and "recommendations:" in out.stdout
    assert not list(tmp_path.iterdir())  # no run directory


@pytest.mark.parametrize("args,message", [
    (["batch_size=-1"], "looplib: error: batch_size: batch_size must be at least 1"),
    (["--world-size", "0"], "looplib: error: --world-size: must be at least 1"),
    (["+precision=fp64"], "looplib: error: In 'config': Could not find 'precision/fp64'"),
])
def test_cli_errors(args, message, tmp_path):
    out = run_cli(*args, cwd=tmp_path, module="looplib.plan")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plan_against_the_allocator_peak_on_a_gpu(precision):
    """The static part is exact; the planned peak should land near the CUDA
    allocator's peak of a real step (the relative error is printed: report it)."""
    cfg = compose_with("model=gpt2_small", "data=random", "batch_size=4", f"+precision={precision}")
    plan = build_plan(cfg.copy(), memory=torch.cuda.get_device_properties(0).total_memory)
    from looplib.cli.main import build_job
    job = build_job(cfg)
    opt = job.optim.build(job.model)
    batch = {"input_ids": torch.randint(0, 512, (4, 1024), device="cuda"),
             "labels": torch.randint(0, 512, (4, 1024), device="cuda")}
    for _ in range(2):  # the second step: optimizer state exists, as in training
        torch.cuda.reset_peak_memory_stats()
        with job.precision.autocast():
            loss = job.objective(job.model, batch) / 4096
        job.precision.backward(loss)
        job.precision.step(opt)
        opt.zero_grad(set_to_none=True)  # as the loop does: no gradients during the next forward
    peak = torch.cuda.max_memory_allocated()
    planned = plan.peak(4)
    print(f"\nplan {planned / 2**20:.0f} MiB, allocator peak {peak / 2**20:.0f} MiB, error {planned / peak - 1:+.1%}")
    assert 0.7 < planned / peak < 1.3


def test_fsdp_per_rank_and_the_engine_choice():
    """FSDP2 per rank = (parameters + gradients + optimizer state) / world, which is ZeRO-3's
    model state, plus the largest unit gathered whole with its unsharded gradients. The engine
    recommended is DDP while the model state fits, then the first sharding that fits."""
    cfg = compose_with("data=random", "batch_size=4", "model.n_layer=8")
    plan = build_plan(cfg.copy(), memory=2**30, world=8)
    d = 128  # one Block: qkv + proj + 2 MLP matrices (12 d^2), their biases (9 d), 2 LayerNorms (4 d)
    assert plan.fsdp_unit == ("blocks.0", 4 * (12 * d * d + 9 * d + 4 * d))  # fp32: 4 bytes each
    sharded = -(-(plan.weights + plan.gradients + plan.optim_state) // 8)
    assert sharded == zero_per_rank(*plan.zero_layout(), 8, 3)
    assert plan.fsdp() == sharded + 2 * plan.fsdp_unit[1] and plan.fsdp(offload=True) == 2 * plan.fsdp_unit[1]
    act = plan.act_ckpt.at(1)

    def choice(usable):
        return recommendations(build_plan(cfg.copy(), memory=int(usable / 0.9) + 1, world=8))[-1]
    assert "+engine=ddp over 8 rank(s)" in choice(2**30)
    assert "+engine=fsdp (shards + the largest unit, blocks.0, gathered) over 8 rank(s)" in choice(plan.fsdp() + act)
    assert "DeepSpeed ZeRO-2" in choice(zero_per_rank(*plan.zero_layout(), 8, 2) + act)
    assert "+engine=fsdp engine.offload=cpu" in choice(plan.fsdp(offload=True) + act)
    assert "use more ranks" in choice(act // 2)


def test_under_lora_gradients_and_optimizer_state_are_planned_for_the_adapter_only():
    """+peft=lora: weights for the whole model, gradients and optimizer state for the parameters
    that train, equal to the adapted model's real ones after a step."""
    pytest.importorskip("peft", reason="peft is not installed (pip install 'looplib[peft]')")
    from looplib.cli.instantiate import instantiate
    cfg = compose_with("model=tiny", "+peft=lora", "data=random")
    plan = build_plan(cfg, memory=2**30)

    torch.manual_seed(0)
    model = instantiate(cfg, "peft").wrap(instantiate(cfg, "model"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = instantiate(cfg, "optim").build(model)
    ids = torch.randint(0, model.vocab_size, (2, 16))
    loss = instantiate(cfg, "loss")(model, {"input_ids": ids, "labels": ids})
    loss.backward()
    opt.step()
    assert plan.n_params == sum(p.numel() for p in trainable) < plan.n_total == sum(p.numel() for p in model.parameters())
    assert plan.weights == sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert plan.gradients == sum(p.grad.untyped_storage().nbytes() for p in trainable)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert plan.optim_state == real_state_bytes(opt) > 0

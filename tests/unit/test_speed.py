"""Speed options that change how a step runs, not what it computes: the chunked linear +
cross-entropy loss, the padded vocabulary, compile modes and fp8. Each is checked against the
plain computation (fp32, tight tolerances), and the GPU-only ones for their one-line refusal."""

import pytest
import torch
import torch.nn.functional as F

from looplib import ConfigError
from looplib.compile import TorchCompile
from looplib.evaluation import evaluate
from looplib.engines import Engine
from looplib.models import GPT
from looplib.loss import ChunkedTokenCrossEntropy, TokenCrossEntropy, linear_cross_entropy
from looplib.precision import FP8, Precision

from conftest import gpu, random_tokens, tiny_gpt


def batch_with_ignored(vocab=64, n=3, seq_len=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100   # a prompt
    labels[2, -3:] = -100  # padding
    return {"input_ids": ids[:, :-1], "labels": labels}


def loss_and_grads(model, objective, batch):
    model.zero_grad(set_to_none=True)
    loss = objective(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_chunked_loss_equals_the_plain_loss_and_its_gradients():
    batch = batch_with_ignored()
    plain_loss, plain = loss_and_grads(tiny_gpt(), TokenCrossEntropy(), batch)
    # 48 tokens in chunks of 7: the last chunk is short; and one chunk holding everything
    for chunk in (7, 4096):
        loss, grads = loss_and_grads(tiny_gpt(), ChunkedTokenCrossEntropy(chunk_size=chunk), batch)
        torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-5)
        for name in plain:
            torch.testing.assert_close(grads[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    assert ChunkedTokenCrossEntropy().count(batch) == TokenCrossEntropy().count(batch) == 48 - 8
    # evaluation (inference mode: no gradients are made) gives the same mean loss
    model = tiny_gpt()
    args = ([batch], Precision(), Engine("cpu"))
    assert evaluate(model, args[0], ChunkedTokenCrossEntropy(chunk_size=5), *args[1:]) == pytest.approx(
        evaluate(model, args[0], TokenCrossEntropy(), *args[1:]), rel=1e-6)


def test_linear_cross_entropy_with_bias_and_padding_columns_matches_pytorch():
    torch.manual_seed(0)
    hidden, weight, bias = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((23, 8), (13, 8), (13,)))
    labels = torch.randint(0, 11, (23,))
    labels[::4] = -100
    ref = F.cross_entropy(F.linear(hidden, weight, bias)[:, :11], labels, reduction="sum")
    got = linear_cross_entropy(hidden, weight, bias, labels, vocab=11, chunk_size=5)
    torch.testing.assert_close(got, ref)
    grads = torch.autograd.grad(3 * got, (hidden, weight, bias))
    for a, b in zip(grads, torch.autograd.grad(3 * ref, (hidden, weight, bias))):
        torch.testing.assert_close(a, b)
    assert grads[1][11:].abs().max() == 0 and grads[2][11:].abs().max() == 0  # padding rows learn nothing


def test_padded_vocabulary_computes_what_the_unpadded_model_does():
    plain = tiny_gpt(vocab=61)
    torch.manual_seed(5)
    padded = GPT(vocab_size=61, seq_len=16, n_layer=2, n_head=2, d_model=32, pad_vocab_to=64)
    assert padded.tok_emb.weight.shape[0] == padded.lm_head.weight.shape[0] == 64
    assert padded.head.weight is padded.tok_emb.weight  # still tied
    with torch.no_grad():
        for name, p in padded.named_parameters():
            src = dict(plain.named_parameters())[name]
            p[:src.shape[0]].copy_(src)  # copied weights; padding rows keep their random values
    batch = batch_with_ignored(vocab=61)
    assert padded(batch["input_ids"]).shape[-1] == 61  # padding never shows as a logit
    for objective in (TokenCrossEntropy(), ChunkedTokenCrossEntropy(chunk_size=9)):
        ref_loss, ref = loss_and_grads(plain, objective, batch)
        loss, grads = loss_and_grads(padded, objective, batch)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
        for name in ref:
            torch.testing.assert_close(grads[name][:ref[name].shape[0]], ref[name], rtol=1e-5, atol=1e-6, msg=name)
        assert grads["tok_emb.weight"][61:].abs().max() == 0
    # sampling sees the true vocabulary only: the same tokens from the same seed
    prompt = batch["input_ids"][:1, :4]
    outs = [m.generate(prompt, 6, generator=torch.Generator().manual_seed(0)) for m in (plain, padded)]
    torch.testing.assert_close(outs[0], outs[1])
    assert padded.flops_per_sequence() > plain.flops_per_sequence()  # the padded matmul is what runs


def test_chunked_loss_on_a_transformers_model():
    pytest.importorskip("transformers")
    from test_hf import tiny_llama
    batch = batch_with_ignored()
    ref_loss, ref = loss_and_grads(tiny_llama(), TokenCrossEntropy(), batch)
    loss, grads = loss_and_grads(tiny_llama(), ChunkedTokenCrossEntropy(chunk_size=10), batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_loss_names_what_a_model_lacks():
    class Plain(torch.nn.Module):
        def forward(self, ids, hidden_only=False):
            return torch.zeros(*ids.shape, 4, requires_grad=True)
    with pytest.raises(ConfigError, match="has no lm_head"):
        ChunkedTokenCrossEntropy()(Plain(), batch_with_ignored())
    with pytest.raises(ConfigError) as err:
        ChunkedTokenCrossEntropy(chunk_size=0)
    assert err.value.key == "loss.chunk_size"
    if not torch.cuda.is_available():  # Liger's kernels are Triton: refused before anything imports
        from looplib.loss import LigerTokenCrossEntropy
        with pytest.raises(ConfigError, match="loss=lm_liger needs a CUDA GPU.*use loss=lm_chunked"):
            LigerTokenCrossEntropy()


def test_compiled_loss_equals_eager():
    batch = batch_with_ignored()
    ref_loss, ref = loss_and_grads(tiny_gpt(), TokenCrossEntropy(), batch)
    torch._dynamo.reset()
    strategy = TorchCompile(backend="aot_eager", loss=True)  # dynamo and autograd's tracing, no codegen: quick
    objective = strategy.wrap_loss(TokenCrossEntropy())
    assert objective.count(batch) == 40 and objective.ignore_index == -100
    loss, grads = loss_and_grads(strategy.wrap(tiny_gpt()), objective, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)
    report = strategy.report()
    assert report["compiles"] >= 1 and report["compile_s"] > 0


def test_the_end_of_run_sample_runs_on_the_uncompiled_model(capsys):
    """Generation is never compiled by the training compile: a prompt growing by a token a step
    would recompile (issue 28: a 52 s sample after a 30 s job)."""
    from types import SimpleNamespace
    from looplib.engines import Engine
    from looplib.precision import Precision
    from looplib.run.training import print_sample
    torch._dynamo.reset()
    strategy = TorchCompile(backend="aot_eager")
    model = strategy.wrap(tiny_gpt())
    data = SimpleNamespace(sample_prompt=lambda: "ab", encode=lambda t: [1, 2], decode=lambda ids: str(ids))
    job = SimpleNamespace(model=model, data=data, engine=Engine("cpu"), precision=Precision(),
                          settings=SimpleNamespace(seed=0))
    print_sample(job, 5)
    assert "a sample from the trained model" in capsys.readouterr().out
    assert strategy.report()["compiles"] == 0
    model(torch.zeros(1, 4, dtype=torch.long))  # training's forward still is compiled
    assert strategy.report()["compiles"] == 1


def test_reduce_overhead_is_refused_where_cuda_graphs_cannot_run():
    with pytest.raises(ConfigError) as err:
        TorchCompile(mode="reduce-overhead", dynamic=True)
    assert err.value.key == "compile.dynamic"
    class Padded:  # a corpus that pads each batch to its longest example (data=instruct, pack=false)
        collate = staticmethod(lambda samples: samples)
    with pytest.raises(ConfigError, match="pads each batch to its longest example"):
        TorchCompile(mode="reduce-overhead").check(Padded())
    TorchCompile(mode="default").check(Padded())
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="reduce-overhead records CUDA graphs, and the model is on cpu"):
            TorchCompile(mode="reduce-overhead").wrap(tiny_gpt())


def test_fp8_conversion_skips_the_head_and_unaligned_layers():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear
    from looplib.precision import float8_training
    model = GPT(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=40)  # 40: not a multiple of 16
    model.blocks[1].attn.qkv = torch.nn.Linear(32, 96)  # aligned, but listed in skip
    aligned = GPT(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)
    keys = list(aligned.state_dict())
    FP8(skip=["blocks.1.attn.qkv"]).convert(model)
    float8_training(aligned)
    converted = lambda m: sorted(n for n, x in m.named_modules() if isinstance(x, Float8Linear))  # noqa: E731
    assert converted(model) == []
    assert converted(aligned) == ["blocks.0.attn.proj", "blocks.0.attn.qkv", "blocks.0.mlp.0", "blocks.0.mlp.2"]
    assert type(aligned.head) is torch.nn.Linear and aligned.head.weight is aligned.tok_emb.weight
    assert list(aligned.state_dict()) == keys  # checkpoints keep their names


# ---- on a GPU (scripts/gpu_figures.sh speed_tests): the options run, and agree with their plain twins


def train_steps(model, objective, steps=3, precision=None, compile_=None, accum=2):
    from looplib import Accumulation, fit
    from looplib.optim import SGD
    from conftest import random_tokens
    device = torch.device("cuda")
    precision = precision or Precision()
    precision.setup(device)
    model = precision.convert(model).to(device)
    if compile_ is not None:
        model, objective = compile_.wrap(model), compile_.wrap_loss(objective)
    data = torch.utils.data.DataLoader(random_tokens(n=4 * accum * steps), batch_size=4)
    opt = SGD(lr=0.1).build(model)
    fit(model, data, objective=objective, optimizer=opt, accumulation=Accumulation(accum), max_steps=steps,
        precision=precision, engine=Engine(device))
    batch = {k: v.to(device) for k, v in next(iter(data)).items()}
    with torch.no_grad(), precision.autocast():
        return float(TokenCrossEntropy()(model, batch) / TokenCrossEntropy().count(batch))


def chunked_matches_plain_in_bf16(device: str) -> None:
    """The chunked loss and its gradients against the plain loss's, both under bf16 autocast. The
    gradients are compared as whole tensors (the norm of the difference within 1% of the
    gradient's norm): bf16 rounds each matmul's output to 8 bits, so a summed loss's gradients
    (up to ~5 here) differ elementwise by up to ~2e-2 where terms cancel (on the CPU: 1.35e-2 at
    a relative norm of 1.9e-3; the elementwise 1e-3 of the H200's run on 2026-11-28 failed so),
    while a chunk lost or counted twice moves the norm by ~1/7."""
    batch = {k: v.to(device) for k, v in batch_with_ignored().items()}
    results = []
    for objective in (TokenCrossEntropy(), ChunkedTokenCrossEntropy(chunk_size=7)):
        model = tiny_gpt().to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            results.append(loss_and_grads(model, objective, batch))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-2, atol=1e-2)
    for name, want in results[0][1].items():
        got = results[1][1][name]
        assert (got - want).norm() <= 1e-2 * want.norm(), (name, float((got - want).norm() / want.norm()))


def test_chunked_loss_in_bf16_matches_the_plain_loss_on_the_cpu():
    chunked_matches_plain_in_bf16("cpu")


@gpu
def test_gpu_chunked_loss_in_bf16_matches_the_plain_loss():
    from looplib.precision import BF16
    chunked_matches_plain_in_bf16("cuda")
    assert train_steps(tiny_gpt(), ChunkedTokenCrossEntropy(), precision=BF16()) == pytest.approx(
        train_steps(tiny_gpt(), TokenCrossEntropy(), precision=BF16()), rel=2e-2)


@gpu
def test_gpu_cuda_graphs_train_like_eager():
    torch._dynamo.reset()
    eager = train_steps(tiny_gpt(), TokenCrossEntropy(), accum=1)
    graphs = train_steps(tiny_gpt(), TokenCrossEntropy(), compile_=TorchCompile(mode="reduce-overhead"), accum=1)
    assert graphs == pytest.approx(eager, rel=1e-3)  # one backward per step: accumulation is refused


@gpu
def test_gpu_fp8_trains_close_to_bf16_or_is_refused_below_sm89():
    pytest.importorskip("torchao")
    from looplib.precision import BF16
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ConfigError, match="compute capability >= 8.9"):
            FP8().setup(torch.device("cuda"))
        return
    def model():
        torch.manual_seed(0)
        return GPT(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64)
    bf16 = train_steps(model(), TokenCrossEntropy(), precision=BF16())
    fp8 = train_steps(model(), TokenCrossEntropy(), precision=FP8(), compile_=TorchCompile())
    assert fp8 == pytest.approx(bf16, rel=5e-2)


@gpu
def test_gpu_liger_loss_matches_the_chunked_loss():
    pytest.importorskip("liger_kernel")
    from looplib.loss import LigerTokenCrossEntropy
    batch = {k: v.cuda() for k, v in batch_with_ignored().items()}
    ref, ref_grads = loss_and_grads(tiny_gpt().cuda(), ChunkedTokenCrossEntropy(), batch)
    got, grads = loss_and_grads(tiny_gpt().cuda(), LigerTokenCrossEntropy(), batch)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-4, msg=name)


def test_torchao_adam8bit_state_is_8bit_and_planned_exactly():
    """+optim=adam8bit_ao: one step (torch.compile bypassed: its CPU compile takes minutes) makes
    8-bit moments for large tensors, fp32 ones for small; the planner's rule counts them exactly."""
    pytest.importorskip("torchao")
    from unittest import mock

    from looplib.optim import TorchaoAdam8bit
    from looplib.plan import state_rule
    torch.manual_seed(0)
    model = GPT(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=64)
    factory = TorchaoAdam8bit(lr=1e-3, weight_decay=0.1)
    opt = factory.build(model)
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    with mock.patch("torch.compile", lambda fn, **kw: fn):
        opt.step()

    def nbytes(t):
        if hasattr(t, "__tensor_flatten__"):  # OptimState8bit: codes, scale, qmap
            return sum(nbytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()
    assert sum(nbytes(v) for s in opt.state.values() for v in s.values()) == state_rule(factory, model)
    big, small = opt.state[model.blocks[0].mlp[0].weight], opt.state[model.blocks[0].ln1.weight]
    assert big["exp_avg"].codes.dtype == torch.uint8 and small["exp_avg"].dtype == torch.float32


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graphs_over_the_whole_step_with_clipping_train_like_eager():
    """+compile=reduce_overhead compile.optimizer=true with clipping active (max norm 0.05, below
    every step's gradient norm) and a NaN gradient at step 4: the compiled forward, backward and the
    clip-and-step region (gradient norm, clipping, the skip on the device, AdamW's update; its
    learning rate a device tensor the schedule writes into; inductor's kernels outside any CUDA graph,
    which would free the backward graph's gradients: looplib.compile.step_options): the forward and
    backward replay as CUDA graphs, no cudagraph skipped (torch._inductor's counter), the eager clip
    run at the first real update only; the metrics row's lr a number. The losses and gradient norms follow the
    eager run's (fp32, rel 1e-4: inductor's kernels round otherwise), the same steps skipped."""
    from unittest import mock
    from looplib import AdamW, Accumulation, fit
    from looplib.loop import clip_grad_norm
    from looplib.telemetry import Telemetry
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees
    from conftest import random_tokens

    class Poisoned(TokenCrossEntropy):
        calls = 0

        def __call__(self, model, batch):
            self.calls += 1
            loss = super().__call__(model, batch)
            return loss * float("nan") if self.calls == 4 else loss  # step 4 (one micro-batch a step)

    def run(strategy, clips):
        torch.manual_seed(0)
        model = GPT(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64).cuda()
        optimizer = AdamW(lr=1e-3, impl="foreach").build(model)
        if strategy is not None:
            model = strategy.wrap(model)
            strategy.compile_step(optimizer)
        rows = []
        telemetry = Telemetry(enabled=False, log_every=1, total_steps=8, device="cuda")
        telemetry.write = rows.append
        data = torch.utils.data.DataLoader(random_tokens(n=64), batch_size=4)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
        with mock.patch("looplib.loop.clip_grad_norm", lambda *a: clips.append(1) or clip_grad_norm(*a)):
            fit(model, data, objective=Poisoned(), optimizer=optimizer, accumulation=Accumulation(1), max_steps=8,
                max_grad_norm=0.05, telemetry=telemetry, scheduler=schedule, engine=Engine("cuda"), compile=strategy)
        assert all(type(r["lr"]) is float for r in rows)
        return [(r["loss"], r["grad_norm"], r["skipped_steps"]) for r in rows]

    torch._dynamo.reset()
    eager = run(None, [])
    counters.clear()
    clips = []
    graphs = run(TorchCompile(mode="reduce-overhead", optimizer=True), clips)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and len(manager.ids_to_funcs) >= 2  # forward, backward
    assert not any(hint for node in manager.non_cudagraph_managed_mutation_hint.values() for hint in node.values())
    assert len(clips) == 1  # the first real update; the other steps clip in the graph
    assert [r[2] for r in graphs] == [r[2] for r in eager] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert all(r[1] > 0.05 for r in eager if r[1] == r[1])
    for got, want in zip(graphs, eager):
        assert got[:2] == pytest.approx(want[:2], rel=1e-4, nan_ok=True)


def meta_linears(*shapes):
    """Linear layers of the given (in, out) widths on the meta device (no memory), named l0, l1, ..."""
    return torch.nn.ModuleDict({f"l{i}": torch.nn.Linear(k, n, device="meta") for i, (k, n) in enumerate(shapes)})


def test_fp8_leaves_layers_too_small_to_gain_in_bf16_by_recipe():
    """precision.filter=size (the default): a linear layer goes to fp8 only where its matmul is large
    enough to pay for the casts (looplib.precision.big_enough: torchao's H100 thresholds per recipe);
    filter=none converts every layer whose widths are multiples of 16."""
    pytest.importorskip("torchao")
    converted = lambda m: sorted(n for n, x in m.named_modules() if type(x).__name__ == "Float8Linear")  # noqa: E731
    shapes = [(4096, 1024), (4096, 1040), (8192, 512), (1024, 4096), (2048, 4096), (2048, 8192), (4096, 4096),
              (8200, 8200)]
    for recipe, want in [("tensorwise", ["l1", "l2", "l3", "l4", "l5", "l6"]), ("rowwise", ["l5", "l6"])]:
        model = meta_linears(*shapes)
        FP8(recipe=recipe).convert(model)
        assert converted(model) == want, recipe
    model = meta_linears(*shapes, (32, 48))
    FP8(filter="none").convert(model)
    assert converted(model) == ["l0", "l1", "l2", "l3", "l4", "l5", "l6", "l8"]  # 8200 is not a multiple of 16


def test_fp8_all_gathers_under_fsdp_only_with_the_tensorwise_recipe():
    """precision.fsdp_all_gather: auto gathers fp8 weights under +engine=fsdp with tensorwise scales
    (torchao's weight wrapper that casts before the all-gather), bf16 otherwise; true is refused
    with a rowwise recipe and without FSDP, in one line naming the key."""
    pytest.importorskip("torchao")
    from looplib.engines.fsdp import FSDP
    with pytest.raises(ConfigError, match="fp8 all-gathers need the tensorwise recipe.*not rowwise") as err:
        FP8(recipe="rowwise", fsdp_all_gather=True)
    assert err.value.key == "precision.fsdp_all_gather"
    with pytest.raises(ConfigError, match="this run has no \\+engine=fsdp") as err:
        FP8(fsdp_all_gather=True).setup(torch.device("cpu"))  # before the device is even asked
    assert err.value.key == "precision.fsdp_all_gather"
    for bad, key in [({"recipe": "blockwise"}, "precision.recipe"), ({"filter": "tiny"}, "precision.filter"),
                     ({"fsdp_all_gather": "yes"}, "precision.fsdp_all_gather")]:
        with pytest.raises(ConfigError) as err:
            FP8(**bad)
        assert err.value.key == key
    cases = {("tensorwise", "auto"): True, ("rowwise", "auto"): False, ("tensorwise", False): False}
    for (recipe, gather), want in cases.items():
        precision = FP8(recipe=recipe, fsdp_all_gather=gather)
        assert precision.all_gather() is False  # not sharded: never
        if not torch.cuda.is_available():
            with pytest.raises(ConfigError, match="fp8 needs a CUDA GPU"):
                FSDP(device="cpu").precision_for(precision)  # marks it sharded, then refuses the CPU
        else:
            precision.sharded = True
        assert precision.sharded and precision.all_gather() is want
        model = meta_linears((8192, 8192))
        precision.convert(model)
        assert (type(model["l0"].weight).__name__ == "WeightWithDynamicFloat8CastTensor") is want


# ---- no host-device synchronisation on a step that does not log


HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


@pytest.mark.parametrize("compiled", [False, True], ids=["fused", "compiled-clip-and-step"])
def test_a_step_that_does_not_log_reads_nothing_back_through_train_model(tmp_path, monkeypatch, compiled):
    """The CPU stand-in for torch.cuda.set_sync_debug_mode("error"), on the whole hot path that
    train_model runs (assembly, telemetry, the checkpoint policy's bad-step rule, the fused
    optimizer's on-device skip, or, ``compiled``, the clip-and-step compiled in one region with
    its skip on the device: compile.optimizer=true, a constant learning rate): every way a
    tensor's value reaches the host (.item(), float(), int(), bool(), .tolist(), .numpy(),
    indexing with a tensor) is counted, but for the objective's item count (``count(batch)``),
    which reads the host batch by design before it moves to the device. Runs of 4 and 12 steps
    that log at the same two steps (the first and the last) read exactly as often: a read on any
    step that does not log would add 8."""
    import sys as _sys
    from looplib import AdamW, train_model
    from looplib.schedule import Constant
    options = dict(optim=AdamW(impl="foreach"), compile=TorchCompile(backend="aot_eager", optimizer=True),
                   schedule=Constant()) if compiled else dict(optim=AdamW(impl="fused"))
    from looplib.accumulation import Accumulation as Windows
    counts = {}
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            frame = _sys._getframe(1)
            while frame is not None and frame.f_code is not Windows.close.__code__:
                frame = frame.f_back
            if frame is None:  # not inside the window's count of its host batches
                counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    seen = []
    for steps in (4, 12):
        counts.clear()
        torch._dynamo.reset()
        train_model(tiny_gpt(), random_tokens(n=256), max_steps=steps, batch_size=4, accum_steps=2, device="cpu",
                    **options, log_every=1000, eval_samples=0, run_dir=tmp_path / f"run{steps}",
                    checkpoint_every=1000, export=None, progress="lines")
        seen.append(dict(counts))
    monkeypatch.undo()
    assert seen[0] == seen[1], seen


@gpu
def test_gpu_steps_that_do_not_log_never_synchronise():
    """torch.cuda.set_sync_debug_mode("error") around every step that does not log (bf16, the
    default fused AdamW with its on-device inf/NaN skip, clipping, accumulation, pinned batches
    moved without blocking): any host-device synchronisation in them raises. The logging steps
    (their .item()) run with the mode off; two warm-up steps first (lazy initialisation)."""
    from looplib import AdamW, Accumulation, fit
    from looplib.data import build_loader
    from looplib.loop import TrainState
    from looplib.precision import BF16
    from looplib.telemetry import Telemetry

    class Strict(Telemetry):
        def _log(self, *args, **kwargs):
            torch.cuda.set_sync_debug_mode(0)
            try:
                super()._log(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64).to(device)
    optimizer = AdamW(lr=1e-3).build(model)  # auto: fused on CUDA
    precision = BF16()
    precision.setup(device)
    loader = build_loader(random_tokens(n=256), batch_size=4, seed=0, device=device)  # pinned
    state, logged = TrainState(), []
    kw = dict(objective=TokenCrossEntropy(), optimizer=optimizer, precision=precision, accumulation=Accumulation(2),
              engine=Engine(device), max_grad_norm=1.0, state=state)
    fit(model, loader, max_steps=2, **kw)  # warm-up: allocations, cuBLAS handles
    telemetry = Strict(enabled=False, log_every=5, total_steps=12, device=device)
    telemetry.write = logged.append
    torch.cuda.set_sync_debug_mode("error")
    try:
        fit(model, loader, max_steps=12, telemetry=telemetry, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert state.step == 12 and [row["step"] for row in logged] == [5, 10, 12]


def test_fp8_all_gather_weights_export_as_their_fp32_tensors(tmp_path):
    """Under +engine=fsdp +precision=fp8 the gathered state dict holds torchao's fp8 all-gather
    wrappers, whose storage safetensors cannot read (the export failed at the end of the GPU test
    on an H200, 2026-11-28): the file holds the fp32 weight inside, tied names stored once."""
    pytest.importorskip("torchao")
    from safetensors.torch import load_file
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    from looplib.engines.local import write_safetensors
    weight = torch.randn(4, 4)
    wrapped = WeightWithDynamicFloat8CastTensor(weight, LinearMMConfig(), torch.float8_e4m3fn).detach()
    assert type(wrapped) is not torch.Tensor
    write_safetensors({"w": wrapped, "tied": wrapped, "b": torch.ones(2)}, tmp_path / "model.safetensors")
    got = load_file(tmp_path / "model.safetensors")
    assert len(got) == 2 and torch.equal(got["b"], torch.ones(2))  # the tied pair once, under one of its names
    stored = got["w"] if "w" in got else got["tied"]
    assert stored.dtype == torch.float32 and torch.equal(stored, weight)

"""+compile=default: torch.compile of the model, through the loop, with accumulation. One test
(compiling costs tens of seconds on a CPU); the YAML files themselves are built by test_config."""
import pytest
import torch

from looplib import Accumulation, ConfigError, TorchCompile, fit
from looplib.loss import TokenCrossEntropy

from conftest import random_tokens, tiny_gpt


@pytest.mark.parametrize("kwargs,key", [({"mode": "fastest"}, "compile.mode"), ({"backend": "nope"}, "compile.backend")])
def test_bad_compile_settings_are_refused_at_build_time(kwargs, key):
    with pytest.raises(ConfigError) as err:
        TorchCompile(**kwargs)
    assert err.value.key == key


# ---- issue 33: the optimizer step compiled, regional compilation (aot_eager: dynamo and autograd's
# tracing without inductor's code generation, seconds on a CPU; the GPU runs inductor)


def train(model, optimizer, steps=4, accum=2, schedule=None, seed=3, strategy=None):
    """Losses per step of ``fit`` (clipping at 1.0, accumulation), read from the telemetry rows
    (with a compile ``strategy``, its clip-and-step; each row holds its compiles so far)."""
    from looplib.telemetry import Telemetry
    rows = []
    telemetry = Telemetry(enabled=False, log_every=1, total_steps=steps)
    telemetry.write = rows.append
    if strategy is not None:
        telemetry.compiled = strategy.report
    data = torch.utils.data.DataLoader(random_tokens(n=4 * accum * steps, seed=seed), batch_size=4)
    fit(model, data, objective=TokenCrossEntropy(), optimizer=optimizer, accumulation=Accumulation(accum),
        max_steps=steps, max_grad_norm=1.0, telemetry=telemetry, scheduler=schedule(optimizer) if schedule else None,
        compile=strategy)
    return [r["loss"] for r in rows], rows


@pytest.mark.parametrize("impl,schedule", [("foreach", None), ("for-loop", "decay")])
def test_compiled_optimizer_step_trains_like_the_eager_step(impl, schedule):
    """compile.optimizer=true: AdamW's step (with the clipping, in one region) through torch.compile,
    its step hooks included (the count of real updates: no step reported skipped), equal to the
    eager step to fp32 rounding; the first real update runs eagerly (it makes the moments), the
    region compiles at the second step, and once more where the schedule changes the learning rate
    (dynamo then makes the rate a symbol), never after."""
    from looplib import AdamW
    decay = (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))) if schedule else None
    model = tiny_gpt()
    eager_losses, _ = train(model, AdamW(lr=1e-2, impl=impl).build(model), schedule=decay)
    eager = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch._dynamo.reset()
    strategy = TorchCompile(backend="aot_eager", optimizer=True)
    model = tiny_gpt()
    optimizer = AdamW(lr=1e-2, impl=impl).build(model)
    strategy.compile_step(optimizer)
    assert "step" not in vars(optimizer)  # the optimizer as it was: checkpoints and schedules hold it
    losses, rows = train(model, optimizer, schedule=decay, strategy=strategy)
    compiles = [r["compiles"] for r in rows]
    assert compiles[0] == 0 and compiles[1] == 1 and compiles[-2] == compiles[-1] <= 2, compiles
    assert [r["skipped_steps"] for r in rows] == [0, 0, 0, 0]
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    # the same formula, rounded in another order: Adam divides by sqrt(v), so a weight whose gradients
    # are near zero moves by up to lr either way on a rounding difference (seen: 1.8e-5 at lr 1e-2)
    torch.testing.assert_close(torch.cat([p.detach().flatten() for p in model.parameters()]), eager,
                               rtol=1e-5, atol=1e-4)


def test_compiled_optimizer_step_refuses_fused_kernels_and_foreign_optimizers():
    from looplib import AdamW
    strategy = TorchCompile(backend="aot_eager", optimizer=True)
    with pytest.raises(ConfigError, match="runs fused kernels already.*use optim.impl=foreach") as err:
        strategy.compile_step(AdamW(impl="fused").build(tiny_gpt()))
    assert err.value.key == "compile.optimizer"
    with pytest.raises(ConfigError, match="steps its own optimizer"):
        strategy.compile_step(object())
    with pytest.raises(ConfigError, match="optim.impl=auto steps AdamW with fused kernels on this device"):
        strategy.check_optimizer(AdamW(), "cuda")  # at build time, before any model exists
    strategy.check_optimizer(AdamW(), "cpu")  # auto is foreach on a CPU
    strategy.check_optimizer(AdamW(impl="foreach"), "cuda")
    plain = AdamW(impl="fused").build(tiny_gpt())
    eager = TorchCompile(backend="aot_eager")
    eager.compile_step(plain)
    assert eager.steps is None and "step" not in vars(plain)


class Poisoned(TokenCrossEntropy):
    """The token loss, NaN at one micro-batch (``at``, counted from 1): its window's gradients are NaN."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls = at, 0

    def __call__(self, model, batch):
        self.calls += 1
        loss = super().__call__(model, batch)
        return loss * float("nan") if self.calls == self.at else loss


def clip_step_run(precision, compiled, steps=5, max_norm=0.05, monkeypatch=None):
    """``steps`` steps of ``fit`` (AdamW foreach, accumulation 2, clipping at ``max_norm``, step 3's
    gradients NaN) with ``compiled``: None (eager), "region" (compile.optimizer=true: the clip-and-step
    region) or "step" (the step alone compiled, clipping eager: the path before the region).
    Returns the rows, the weights, the optimizer's state tensors, the precision, the eager clips
    counted and the compiles of this run."""
    from looplib import AdamW
    from looplib.loop import clip_grad_norm
    from looplib.telemetry import Telemetry
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_gpt()
    optimizer = AdamW(lr=1e-2, impl="foreach").build(model)
    strategy = TorchCompile(backend="aot_eager", optimizer=True)
    if compiled:
        strategy.compile_step(optimizer)
        strategy.steps.plain = compiled == "region"  # False: the region declines, the clip runs eagerly
    precision.setup(torch.device("cpu"))
    clips = []
    monkeypatch.setattr("looplib.loop.clip_grad_norm", lambda *a: clips.append(1) or clip_grad_norm(*a))
    rows = []
    telemetry = Telemetry(enabled=False, log_every=1, total_steps=steps)
    telemetry.write = rows.append
    data = torch.utils.data.DataLoader(random_tokens(n=8 * steps, seed=3), batch_size=4)
    fit(model, data, objective=Poisoned(at=5), optimizer=optimizer, accumulation=Accumulation(2), max_steps=steps,
        precision=precision, max_grad_norm=max_norm, telemetry=telemetry, compile=strategy if compiled else None)
    state = [v for s in optimizer.state.values() for v in s.values()]
    return dict(rows=rows, weights=torch.cat([p.detach().flatten() for p in model.parameters()]), state=state,
                precision=precision, clips=len(clips), compiles=strategy.report().get("compiles"),
                breaks=sum(torch._dynamo.utils.counters["graph_break"].values()))


@pytest.mark.parametrize("name", ["fp32", "fp16"])
def test_clip_and_step_in_one_compiled_region_trains_like_the_eager_step(name, monkeypatch):
    """compile.optimizer=true with clipping active (max norm 0.05, every gradient norm above it) and a
    NaN gradient at step 3: the gradient norm, the clipping, the skip and AdamW's update run in one
    compiled frame (compiled once, no graph break; the loop's eager clip only at the first real
    update, which makes the moments), skip step 3 on the device as the eager step skips it (fp32: the
    norm; fp16: GradScaler's flag, then its update halves the scale), and equal bit for bit the step
    compiled alone after the eager clip (aot_eager: the same aten ops). Against the eager step: the
    same skipped steps and step counts, grad_norm bit for bit at step 2 (the region's norm of the
    same gradients), the weights to Adam's rounding (the compiled step computes its bias corrections
    in fp32 tensors where the eager one uses Python floats; a weight whose gradients are near zero
    then moves by up to lr: atol 1e-4 at lr 1e-2; fp16, whose gradients carry the first update's
    rounding through half-precision matmuls into the second: 5e-3, half of lr; 1.2e-3 seen, in 1 to 36 of
    28,032 weights by machine), and from there the later losses to 1e-5 and
    gradient norms to 5e-5 (fp16's matmuls carry the weights' rounding into the gradients)."""
    from looplib.precision import FP16, Precision
    make = (lambda: FP16(init_scale=256.0)) if name == "fp16" else Precision
    eager, region, step = (clip_step_run(make(), c, monkeypatch=monkeypatch) for c in (None, "region", "step"))
    assert region["clips"] == 1 and step["clips"] == 5 and eager["clips"] == 5
    assert region["compiles"] == 1 and region["breaks"] == 0
    norms = {k: [r["grad_norm"] for r in run["rows"]] for k, run in (("e", eager), ("r", region), ("s", step))}
    assert all(n > 0.05 for n in norms["r"] if n == n)  # clipping changed every finite step's update
    losses = {k: [r["loss"] for r in run["rows"]] for k, run in (("e", eager), ("r", region), ("s", step))}
    for run in (region, step):
        assert [r["skipped_steps"] for r in run["rows"]] == [r["skipped_steps"] for r in eager["rows"]] == [0, 0, 1, 1, 1]
    assert str(norms["r"]) == str(norms["s"]) and str(losses["r"]) == str(losses["s"])  # nan == nan as text
    assert torch.equal(region["weights"], step["weights"])
    assert all(torch.equal(a, b) for a, b in zip(region["state"], step["state"], strict=True))
    assert norms["r"][:2] == norms["e"][:2]  # step 2: the region's norm of the eager weights' gradients
    assert norms["r"] == pytest.approx(norms["e"], rel=5e-5, nan_ok=True)
    assert losses["r"] == pytest.approx(losses["e"], rel=1e-5, nan_ok=True)
    torch.testing.assert_close(region["weights"], eager["weights"], rtol=1e-5, atol=5e-3 if name == "fp16" else 1e-4)
    steps = [t for t in region["state"] if t.ndim == 0]
    assert steps and all(t.item() == 4.0 for t in steps)  # four real updates: the skipped one left no trace
    if name == "fp16":
        assert region["precision"].scaler.get_scale() == eager["precision"].scaler.get_scale() == 128.0


def test_muon_and_a_precision_of_ones_own_under_the_compiled_clip_and_step(monkeypatch):
    """+optim=muon (MuonAdamW: plain tensors, so the region keeps its momentum buffers on a skipped
    step; torch's wrapper of the inner AdamW step breaks the region's graph, so it compiles as a few
    frames at step 2, never after) skips the NaN step as the eager step does and trains like it
    (Newton-Schulz rounds in bf16 either way: atol 1e-3). A precision that overrides ``step`` alone
    keeps the loop's eager path, which runs its ``step`` at every boundary (the region would not)."""
    from looplib.loop import clip_grad_norm
    from looplib.muon import Muon
    from looplib.precision import Precision
    from looplib.telemetry import Telemetry

    class Mine(Precision):
        steps = 0

        def step(self, optimizer, grad_norm=None):
            self.steps += 1
            return super().step(optimizer, grad_norm)

    def run(compiled, precision):
        torch._dynamo.reset()
        model = tiny_gpt()
        optimizer = Muon(lr=1e-2).build(model)
        strategy = TorchCompile(backend="aot_eager", optimizer=True)
        if compiled:
            strategy.compile_step(optimizer)
        rows = []
        telemetry = Telemetry(enabled=False, log_every=1, total_steps=4)
        telemetry.write, telemetry.compiled = rows.append, strategy.report
        data = torch.utils.data.DataLoader(random_tokens(n=32, seed=3), batch_size=4)
        fit(model, data, objective=Poisoned(at=5), optimizer=optimizer, accumulation=Accumulation(2), max_steps=4,
            precision=precision, max_grad_norm=0.05, telemetry=telemetry, compile=strategy if compiled else None)
        return rows, torch.cat([p.detach().flatten() for p in model.parameters()])

    eager, want = run(False, Precision())
    rows, got = run(True, Precision())
    assert [r["skipped_steps"] for r in rows] == [r["skipped_steps"] for r in eager] == [0, 0, 1, 1]
    compiles = [r["compiles"] for r in rows]
    assert compiles[0] == 0 < compiles[1] == compiles[-1], compiles
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    clips = []
    monkeypatch.setattr("looplib.loop.clip_grad_norm", lambda *a: clips.append(1) or clip_grad_norm(*a))
    mine = Mine()
    rows, _ = run(True, mine)
    assert mine.steps == 4 and len(clips) == 4 and [r["skipped_steps"] for r in rows] == [0, 0, 1, 1]


def compiled_blocks(n_layer: int):
    """A GPT of n_layer blocks, each block compiled (regional); one forward and backward: the
    number of frames dynamo compiled, and the loss and gradients."""
    from looplib.models import GPT
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=16, n_layer=n_layer, n_head=2, d_model=32)
    strategy = TorchCompile(backend="aot_eager", regional=True)
    keys = list(model.state_dict())
    assert strategy.wrap(model) is model and list(model.state_dict()) == keys
    batch = {k: v.unsqueeze(0) for k, v in random_tokens(n=1)[0].items()}
    loss = TokenCrossEntropy()(model, batch)
    loss.backward()
    return strategy.report()["compiles"], loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_regional_compilation_compiles_one_block_whatever_the_depth_and_trains_like_eager():
    """compile.regional=true: every Block compiled in place; 2 blocks and 6 blocks compile the same
    number of frames (one graph serves every block: the cold start does not grow with depth), and
    the loss and gradients equal the eager model's."""
    from looplib.models import GPT
    shallow, _, _ = compiled_blocks(2)
    deep, loss, grads = compiled_blocks(6)
    assert shallow == deep >= 1
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=16, n_layer=6, n_head=2, d_model=32)
    batch = {k: v.unsqueeze(0) for k, v in random_tokens(n=1)[0].items()}
    ref = TokenCrossEntropy()(model, batch)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_regional_compilation_refusals():
    with pytest.raises(ConfigError, match="compile the whole model again") as err:
        TorchCompile(regional=True, loss=True)
    assert err.value.key == "compile.loss"
    with pytest.raises(ConfigError, match=r"no submodule of Sequential is one of \['Block'\]") as err:
        TorchCompile(backend="aot_eager", regional=True, blocks=["Block"]).wrap(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert err.value.key == "compile.blocks"

"""The loop against a hand-written reference loop, for every precision x optimizer x accumulation
that runs on the CPU: identical parameters after a few optimizer steps."""
import pytest
import torch
import torch.nn.functional as F

from looplib import optim as lo
from looplib.accumulation import Accumulation
from looplib.data import build_loader
from looplib.engines import Engine
from looplib.loop import fit
from looplib.loss import TokenCrossEntropy
from looplib.precision import BF16, FP16, FP32, TF32

from conftest import gpu, random_tokens, tiny_gpt

STEPS, MICRO, MAX_NORM = 4, 4, 0.5

FACTORIES = {
    "adamw": lambda: lo.AdamW(lr=1e-2, weight_decay=0.1, impl="for-loop"),
    "sgd": lambda: lo.SGD(lr=0.1, weight_decay=0.1, momentum=0.9),
    "adafactor": lambda: lo.Adafactor(lr=1e-2, weight_decay=0.1),
    "adam8bit": lambda: lo.Adam8bit(lr=1e-2, weight_decay=0.1),
}
PRECISIONS = {"fp32": FP32, "tf32": TF32, "bf16": BF16, "fp16": FP16}
# fp32 and tf32 (a no-op on the CPU) must match bit for bit. Under autocast the two loops run
# the same kernels in the same order, so they match exactly too; the tolerance is stated for
# the record and to allow a future kernel with non-deterministic reductions.
TOLERANCE = {"fp32": 0.0, "tf32": 0.0, "bf16": 1e-6, "fp16": 1e-6}


def reference_loop(model, loader, optimizer, accum, dtype, scaler, device="cpu"):
    """A plain PyTorch loop, written the way the guides write it (with item normalisation)."""
    autocast = torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None)
    batches, step = list(loader), 0
    windows = [batches[i:i + accum] for i in range(0, len(batches), accum)]
    for window in windows[:STEPS]:
        n_items = sum(int((b["labels"] != -100).sum()) for b in window)
        for batch in window:
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast:
                logits = model(batch["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                       reduction="sum") / n_items
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
    return step


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("opt_name", list(FACTORIES))
@pytest.mark.parametrize("prec_name", list(PRECISIONS))
def test_loop_matches_reference(prec_name, opt_name, accum):
    if opt_name == "adam8bit":
        pytest.importorskip("bitsandbytes")
    data = random_tokens(n=MICRO * accum * STEPS)

    def loader():
        return build_loader(data, batch_size=MICRO, seed=3, shuffle=True)

    ref_model, model = tiny_gpt(), tiny_gpt()
    ref_opt = FACTORIES[opt_name]().build(ref_model)
    precision = PRECISIONS[prec_name]()
    precision.setup("cpu")
    dtype = getattr(precision, "dtype", None)
    scaler = torch.amp.GradScaler("cpu", enabled=prec_name == "fp16")
    reference_loop(ref_model, loader(), ref_opt, accum, dtype, scaler)

    opt = FACTORIES[opt_name]().build(model)
    state = fit(model, loader(), objective=TokenCrossEntropy(), optimizer=opt, max_steps=STEPS,
                precision=precision, accumulation=Accumulation(accum), engine=Engine("cpu"),
                max_grad_norm=MAX_NORM)
    assert state.step == STEPS
    tol = TOLERANCE[prec_name]
    moved = 0
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
        moved += int(not torch.equal(p, tiny_gpt().get_parameter(name)))
    assert moved > 0, "training changed nothing: the comparison would prove nothing"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("opt_name", ["adamw", "adam8bit"])
@pytest.mark.parametrize("prec_name", ["fp32", "tf32", "bf16", "fp16"])
def test_loop_matches_reference_on_cuda(prec_name, opt_name):
    if opt_name == "adam8bit":
        pytest.importorskip("bitsandbytes")
    accum, device = 2, torch.device("cuda")
    data = random_tokens(n=MICRO * accum * STEPS)

    def loader():
        return build_loader(data, batch_size=MICRO, seed=3, device=device)

    ref_model, model = tiny_gpt().to(device), tiny_gpt().to(device)
    ref_opt = FACTORIES[opt_name]().build(ref_model)
    precision = PRECISIONS[prec_name]()
    precision.setup(device)
    scaler = torch.amp.GradScaler("cuda", enabled=prec_name == "fp16")
    reference_loop(ref_model, loader(), ref_opt, accum, getattr(precision, "dtype", None), scaler, "cuda")
    opt = FACTORIES[opt_name]().build(model)
    fit(model, loader(), objective=TokenCrossEntropy(), optimizer=opt, max_steps=STEPS, precision=precision,
        accumulation=Accumulation(accum), engine=Engine(device), max_grad_norm=MAX_NORM)
    # CUDA kernels may reduce in another order from run to run: 1e-5 relative
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

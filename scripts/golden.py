"""Golden losses of the tiny GPT: regenerate tests/golden/tiny_gpt.json and print the diff.

    python scripts/golden.py            # show the diff against the committed numbers
    python scripts/golden.py --write    # and write the new numbers

The test (tests/unit/test_golden.py) recomputes these losses with the same function and compares.
The same numbers must hold for (batch 8, accumulation 1) and (batch 2, accumulation 4).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "tiny_gpt.json"
STEPS = 8


def golden_losses(micro: int = 8, accum: int = 1, steps: int = STEPS) -> list[float]:
    from looplib import optim as lo
    from looplib.accumulation import Accumulation
    from looplib.data import TokenChunks, build_loader
    from looplib.loop import fit
    from looplib.models import GPT
    from looplib.loss import TokenCrossEntropy
    from looplib.telemetry import Telemetry

    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
    # a learnable stream (every token is the previous one plus 5, mod 64), cut into chunks
    data = TokenChunks((torch.arange(8 * steps * 16 + 1) * 5) % 64, 16)
    loader = build_loader(data, batch_size=micro, seed=2)
    # betas pinned: the committed numbers were made with torch's (0.9, 0.999), before looplib.optim.BETAS
    opt = lo.AdamW(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), impl="for-loop").build(model)
    rows = []
    telemetry = Telemetry(enabled=False, log_every=1)
    telemetry.write = rows.append
    fit(model, loader, objective=TokenCrossEntropy(), optimizer=opt, max_steps=steps,
        accumulation=Accumulation(accum), telemetry=telemetry, max_grad_norm=1.0)
    return [r["loss"] for r in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the new numbers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    new = {"steps": STEPS, "losses": golden_losses()}
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"losses": []}
    print(f"{'step':>4}  {'committed':>12}  {'now':>12}  {'diff':>10}")
    for i, loss in enumerate(new["losses"]):
        before = old["losses"][i] if i < len(old["losses"]) else float("nan")
        print(f"{i + 1:>4}  {before:12.7f}  {loss:12.7f}  {loss - before:10.2e}")
    if args.write:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(new, indent=1) + "\n")
        print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

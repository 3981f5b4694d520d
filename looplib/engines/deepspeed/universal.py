"""DeepSpeed's universal checkpoint, for a ZeRO checkpoint resumed on another number of processes:
made from the saved partitions (``ds_to_universal``) and put right after DeepSpeed loads it."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger("looplib")


def fix_universal_groups(optimizer, built: list[dict], client_state: dict | None) -> None:
    """Two slips of DeepSpeed 0.19.8's ZeRO-3 universal load (stage3.py,
    load_hp_checkpoint_state_from_checkpoint_dir_stage3), put right: it gives every param group
    the hyperparameters of the first (looplib's groups differ: no weight decay on biases, norms,
    embeddings), so each gets its own back, with the learning rate the schedule had reached (the
    client state's); and it hands one ``step`` tensor to every partition, which torch's Adam then
    counts up once per partition per step, so each gets its own (found by a 2 -> 1 process resume
    that drifted from the uninterrupted run by 1e-4 after one step, in the second group only).
    Harmless where nothing slipped (ZeRO 1-2)."""
    last_lr = ((client_state or {}).get("scheduler") or {}).get("_last_lr") or []
    for i, (group, own) in enumerate(zip(optimizer.param_groups, built)):
        group.update({k: v for k, v in own.items() if k != "lr"})
        if i < len(last_lr):
            group["lr"] = last_lr[i]
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


@contextmanager
def universal(checkpoint: Path, scratch: Path, main: bool, world: int, ranks):
    """DeepSpeed's own universal checkpoint of ``checkpoint`` (``deepspeed.checkpoint.ds_to_universal``:
    each parameter's fp32 weights and optimizer state whole, which ZeRO partitions again over any
    number of processes), made by rank 0 in a temporary directory in ``scratch`` (``.tmp-*``: a
    leftover is removed by the next checkpoint's rotation), read by every rank (``(root, tag)``
    for ``DeepSpeedEngine.load_checkpoint``; ``ranks``: the engine's collectives), removed afterwards."""
    import argparse
    import io
    import shutil
    import tempfile
    import time
    from contextlib import redirect_stderr, redirect_stdout

    from deepspeed.checkpoint.ds_to_universal import main as to_universal

    made, error = None, None
    if main:
        t0 = time.perf_counter()
        scratch.mkdir(parents=True, exist_ok=True)
        made = Path(tempfile.mkdtemp(dir=scratch, prefix=f".tmp-universal-{checkpoint.name}-"))
        args = argparse.Namespace(input_folder=str(checkpoint), output_folder=str(made / checkpoint.name),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True)  # one worker: no processes forked from a rank
        said = io.StringIO()
        try:
            with redirect_stdout(said), redirect_stderr(said):  # its progress bars
                to_universal(args)
        except Exception as err:  # noqa: BLE001 - every rank must hear of it
            error = f"{type(err).__name__}: {err}"
        else:
            log.info("DeepSpeed: %s made into a universal checkpoint for %d process(es) (ds_to_universal, %.1f s)",
                     checkpoint.name, world, time.perf_counter() - t0)
    made, error = ranks.from_main((None if made is None else str(made), error))
    try:
        if error:
            raise RuntimeError(f"DeepSpeed's ds_to_universal could not convert {checkpoint}: {error}")
        yield Path(made), checkpoint.name
        ranks.barrier()  # every rank has read it
    finally:
        if main and made is not None:
            shutil.rmtree(made, ignore_errors=True)

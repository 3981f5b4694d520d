"""DeepSpeed's own checkpoint format (``checkpoint_format = "deepspeed"``): ZeRO partitions, every
rank its own, written and read by the ``DeepSpeedEngine``. The same verbs as looplib's formats
(``looplib.store.formats``); it stays here because it drives the ``DeepSpeedEngine`` the
``DeepSpeed`` engine made, which it receives as its argument (``engine.ds``)."""
from __future__ import annotations

from pathlib import Path

from ...errors import ConfigError
from . import muon as ds_muon
from .universal import fix_universal_groups, universal


class ZeroCheckpoints:
    """DeepSpeed's checkpoint (model, optimizer partitions, loss scaler) plus looplib's client state."""

    name = "deepspeed"
    own_files = True

    def __init__(self, engine):
        self.engine = engine     # the DeepSpeed engine: its DeepSpeedEngine (ds), once prepared
        self.universal = False   # resume through a universal checkpoint (another number of processes)
        self.scratch = None      # where it is made (resuming)

    def save(self, directory: Path, tag: str, parts: dict | None, client_state: dict) -> None:
        """``directory/tag``; every rank calls it. Nothing of DeepSpeed's is left beside looplib's
        step directories: no ``latest`` file (looplib's newest complete checkpoint is the one its
        manifest names) and none of the recovery scripts (``zero_to_fp32.py``, ``zero_to_torch.py``)
        DeepSpeed copies there: ``looplib.generate`` and the exported weights are the way out of a
        ZeRO checkpoint."""
        self.engine.ds.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # rank 0 copies them while it saves
            (Path(directory) / script).unlink(missing_ok=True)

    def stage(self, directory: Path, tag: str, parts: dict, client_state: dict, stage):
        raise NotImplementedError("DeepSpeed writes its ZeRO partitions itself, synchronously "
                                  "(the engine's check refuses checkpoint.async)")

    def resuming(self, checkpoint: Path, saved_world: int, scratch: Path) -> None:
        """ZeRO partitions optimizer state (stage 1-3) or parameters (3) over the processes that
        saved them: on another number of processes they load through DeepSpeed's universal
        checkpoint (``load_universal`` in the derived config; ``load`` converts into ``scratch``,
        never beside a checkpoint of another run)."""
        self.universal = saved_world != self.engine.world_size and any(Path(checkpoint).glob("*zero_pp_rank_*"))
        self.scratch = Path(scratch)

    def load(self, path: Path, parts: dict | None = None, saved_format: str = "deepspeed",
             state: dict | None = None) -> dict:
        """Restore what ``save`` wrote at ``path`` (``directory/tag``) into the ``DeepSpeedEngine``
        (model, optimizer partitions, loss scaler: ``parts`` are its adapters); returns the client
        state. Saved by another number of processes: through a universal checkpoint made from it first."""
        engine, directory, tag = self.engine, Path(path).parent, Path(path).name
        if self.universal and engine.muon:
            raise ConfigError("resume", "a DeepSpeed checkpoint of +optim=muon cannot move to another number of "
                              "processes: DeepSpeed 0.19.8's universal checkpoint (ds_to_universal) looks for Adam's "
                              "exp_avg and fails on Muon's state", "resume on the number of processes that saved it, "
                              "or train with +engine=fsdp or ddp (their checkpoints load on any number)")
        if self.universal:
            optimizer = getattr(engine.ds.optimizer, "optimizer", engine.ds.optimizer)  # the torch optimizer ZeRO steps
            built = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            with universal(Path(directory) / tag, self.scratch or Path(directory), engine.is_main,
                           engine.world_size, engine.ranks) as (root, name):
                path, client_state = engine.ds.load_checkpoint(str(root), tag=name)
            fix_universal_groups(optimizer, built, client_state)
        else:
            path, client_state = engine.ds.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}")
        if engine.muon:  # the load replaced DeepSpeed's param groups: the schedule must set the new ones
            ds_muon.adopt(engine.steps.optimizer, engine.ds.optimizer)
        return client_state

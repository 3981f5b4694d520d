"""One side-by-side row through torchtitan (0.3.0): its Trainer, its Llama 3 model (the 1B flavor:
Llama-3.2-1B's shape), with the settings its docs recommend for speed on one GPU.

    python scripts/peers/titan.py SPEC.json            # written by scripts/bench_peers.py
    python scripts/peers/titan.py SPEC.json --check    # build the config and read a batch: no training

The data are the same rows as every other framework's (a dataloader of torchtitan's kind over
scripts/peers/spec.py's files, in looplib's order); torchtitan needs no tokenizer for them (a
stand-in answers its tokenizer's questions). Its own initial weights (its init, not the Hugging
Face file: the shape is the same, the numbers are not), its own loss and clipping.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = ("torchtitan's Llama 3 1B flavor (its init), torch.compile of model and loss, Float8 (torchao, "
            "rowwise, its default recipe; output and small layers kept in bf16: filter_fqns=[output, "
            "auto_filter_small_kn]), selective activation checkpointing (its default), CUDA graphs over "
            "forward+backward (its 0.3.0 default), bf16 autocast (one device), fused AdamW")


def build_config(spec: dict):
    """torchtitan's Trainer.Config for the job: its llama3 registry's flavor with the converters,
    compile and checkpointing its docs recommend, the job's batch, steps, optimizer and data."""
    import torch
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer
    from torch.utils.data import IterableDataset

    from spec import permutation
    from token_rows import TokenRows

    class StandIn(BaseTokenizer):
        """torchtitan asks its tokenizer for the vocabulary size and the end-of-sequence id only."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config, tokenizer_path: str = ""):
            super().__init__()
            self.vocab_size, self.eos_id = config.vocab_size, 0

        def encode(self, *args, **kwargs):
            raise NotImplementedError("the rows are tokens already")

        def decode(self, *args, **kwargs):
            raise NotImplementedError("the rows are tokens already")

        def get_vocab_size(self):
            return self.vocab_size

    class Rows(IterableDataset):
        def __init__(self, path, seed):
            self.rows = TokenRows(path)
            self.order = permutation(len(self.rows), seed)
            self.positions = torch.arange(self.rows.input_ids.shape[1])

        def __iter__(self):
            while True:  # torchtitan's loaders are infinite
                for i in self.order:
                    row = self.rows[i]  # one document per row: positions from 0 (its block-causal mask is causal)
                    yield {"input": row["input_ids"], "positions": self.positions}, row["labels"]

    class RowsLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            seed: int = 0

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size,
                     snapshot_every_n_steps=None, **kwargs):
            super().__init__(Rows(config.dataset_path, config.seed), dp_rank=dp_rank, dp_world_size=dp_world_size,
                             batch_size=local_batch_size, num_workers=0)

    tiny, cuda = spec["tiny"], spec["device"].startswith("cuda")
    converters = [] if tiny or not cuda else [Float8LinearConverter.Config(
        model_compile_enabled=True, filter_fqns=["output", "auto_filter_small_kn"])]
    model_spec = model_registry("debugmodel" if tiny else "1B", converters=converters)
    vocab = spec["model"]["vocab_size"]
    if not tiny and decoder_vocab_size(model_spec) != vocab:
        raise SystemExit(f"torchtitan's 1B flavor has vocabulary {decoder_vocab_size(model_spec)}, the data {vocab}")
    steps = spec["steps"]
    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path="",  # no Hugging Face files: its own init, no tokenizer
        dump_folder=str(Path(spec["data_dir"]).parent / "titan-dump"),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))),
        tokenizer=StandIn.Config(vocab_size=vocab),
        dataloader=RowsLoader.Config(dataset_path=spec["data_dir"], seed=spec["seed"]),
        optimizer=default_adamw(lr=spec["lr"], betas=tuple(spec["betas"]), eps=spec["eps"],
                                weight_decay=spec["weight_decay"]),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, min_lr_factor=1.0),  # constant, as the others
        training=TrainingConfig(local_batch_size=spec["micro_batch"], global_batch_size=spec["global_batch"],
                                seq_len=spec["seq_len"], steps=steps, max_norm=spec["max_grad_norm"],
                                mixed_precision_param="bfloat16" if cuda else "float32"),
        parallelism=ParallelismConfig(),
        compile=CompileConfig(enable=cuda, components=["model", "loss"]),
        activation_checkpoint=SelectiveAC.Config(),
        checkpoint=CheckpointManager.Config(enable=False),
        metrics=MetricsProcessor.Config(log_freq=1),
    ), torch


def main(spec_path: str, check: bool = False) -> int:
    spec = json.loads(Path(spec_path).read_text())

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}.items():
        os.environ.setdefault(key, value)
    config, torch = build_config(spec)
    if check:  # the config builds and the loader gives the job's batches (needs triton: a GPU build of torch)
        loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=config.tokenizer.build(),
                                         seq_len=spec["seq_len"], local_batch_size=spec["micro_batch"])
        inputs, labels = next(iter(loader))
        print("PEERS_CHECK " + json.dumps({"input": list(inputs["input"].shape), "labels": list(labels.shape),
                                           "flavor": config.model_spec.flavor, "steps": config.training.steps,
                                           "global_batch": config.training.global_batch_size}), flush=True)
        return 0
    from measure import StepClock, emit, reset_peak, summary, versions
    device = torch.device(spec["device"])
    trainer = config.build()
    clock, losses, pending = StepClock(device), [], []
    forward_backward, train_step = trainer.forward_backward_step, trainer.train_step

    def counted_forward_backward(**kw):
        loss = forward_backward(**kw)
        pending.append(loss.detach().float().clone())  # a copy: a CUDA graph replays into the same tensor
        return loss

    def timed_step(data_iterator):
        if clock.start is None:
            reset_peak(device)
            clock.begin()
        out = train_step(data_iterator)
        clock.step_end()
        losses.append(sum(pending))
        pending.clear()
        return out

    trainer.forward_backward_step, trainer.train_step = counted_forward_backward, timed_step
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    emit(summary(spec, clock.step_times(), [float(x) for x in losses], device,
                 versions=versions("torchtitan", "torchao", "torch")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], check="--check" in sys.argv[2:]))

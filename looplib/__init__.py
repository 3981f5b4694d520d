"""looplib: a pure-PyTorch training loop with pluggable strategies and no Trainer class.

    from looplib import BF16, DDP, AdamW, TensorBoard, train_model
    result = train_model(model, dataset, max_steps=1000, batch_size=8, accum_steps=4,
                         precision=BF16(), optim=AdamW(lr=3e-4, weight_decay=0.1))

or, piece by piece, ``fit(model, loader, objective=..., optimizer=..., precision=..., ...)``.
The base classes to subclass are ``Precision``/``Autocast``, ``OptimizerFactory``, ``Schedule``,
``Compile``, ``Evaluation``, ``FullModel`` (peft) and ``Corpus`` (data); see
docs/extending.md. Heavy optional libraries (bitsandbytes, deepspeed, peft, transformers,
matplotlib) are imported only when chosen; importing looplib never imports Hydra.
"""
from .accumulation import Accumulation, Window
from .peft import GPT_LINEARS, FullModel, LoRA, QLoRA, load_lora
from .run.api import Datasets, Trained, train_model
from .store.finished import Finished, load_finished
from .activations import ActivationCheckpointing, Checkpointing, OffloadActivations, SelectiveCheckpointing
from .compile import Compile, NoCompile, TorchCompile
from .data import Corpus, EpochSampler, Epochs, RandomCorpus, RandomTokens, TokenChunks, build_loader
from .engines import DDP, Engine, Local
from .errors import ConfigError, Interrupted, NumericError, RunEnded, SaveError
from .evaluation import Evaluation, HalfWeights, evaluate
from .loop import fit
from .loss import SequenceCrossEntropy, TokenCrossEntropy
from .optim import SGD, Adafactor, Adam8bit, AdamW, OptimizerFactory, list_optimizers, param_groups
from .precision import BF16, FP16, FP32, TF32, Autocast, Precision
from .schedule import Constant, Schedule, WarmupCosine
from .telemetry import Telemetry
from .train_state import TrainState
from .version import __version__


# engines and trackers the docs name beside BF16(), imported when first used: importing looplib
# imports neither deepspeed nor any tracker's library (nor the modules that would)
LAZY = {"FSDP": "looplib.engines.fsdp", "DeepSpeed": "looplib.engines.deepspeed",
        "TensorBoard": "looplib.loggers.tensorboard", "MLflow": "looplib.loggers.mlflow", "WandB": "looplib.loggers.wandb"}


def __getattr__(name: str):
    if name in LAZY:
        import importlib
        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'looplib' has no attribute {name!r}")

__all__ = [
    "fit", "evaluate", "TrainState", "Accumulation", "Window", "Epochs", "EpochSampler", "build_loader",
    "Engine", "Local", "DDP", "FSDP", "DeepSpeed", "TensorBoard", "MLflow", "WandB", "ConfigError", "TokenCrossEntropy", "SequenceCrossEntropy",
    "OptimizerFactory", "AdamW", "SGD", "Adafactor", "Adam8bit", "Schedule", "Constant", "WarmupCosine",
    "list_optimizers", "param_groups", "Precision", "FP32", "TF32", "Autocast", "FP16", "BF16", "Telemetry",
    "train_model", "Trained", "Datasets", "load_finished", "Finished", "RunEnded", "Interrupted", "NumericError", "SaveError", "Corpus", "RandomCorpus", "RandomTokens", "TokenChunks",
    "Compile", "NoCompile", "TorchCompile", "Evaluation", "HalfWeights", "FullModel", "LoRA", "QLoRA", "load_lora",
    "GPT_LINEARS",
    "Checkpointing", "ActivationCheckpointing", "SelectiveCheckpointing", "OffloadActivations",
]

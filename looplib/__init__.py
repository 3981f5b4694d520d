"""looplib: a pure-PyTorch training loop with pluggable strategies and no Trainer class.

    from looplib import fit, FP16, AdamW, Accumulation
    fit(model, loader, objective=TokenCrossEntropy(), optimizer=AdamW(lr=3e-4).build(model),
        precision=FP16(), accumulation=Accumulation(4), max_steps=1000)

Heavy optional libraries (bitsandbytes, deepspeed) are imported only when chosen.
"""
from .accumulation import Accumulation, Window
from .checkpointing import ActivationCheckpointing, Checkpointing
from .data import EpochSampler, Epochs, build_loader
from .engines import Engine, Local
from .errors import ConfigError
from .loop import TrainState, evaluate, fit
from .objectives import SequenceCrossEntropy, TokenCrossEntropy
from .optim import (SGD, Adafactor, Adam8bit, AdamW, Constant, OptimizerFactory, Schedule, WarmupCosine,
                    list_optimizers, param_groups)
from .precision import BF16, FP16, FP32, TF32, Autocast, Precision
from .telemetry import Telemetry

__version__ = "0.1.0"

__all__ = [
    "fit", "evaluate", "TrainState", "Accumulation", "Window", "Epochs", "EpochSampler", "build_loader",
    "Engine", "Local", "ConfigError", "TokenCrossEntropy", "SequenceCrossEntropy",
    "OptimizerFactory", "AdamW", "SGD", "Adafactor", "Adam8bit", "Schedule", "Constant", "WarmupCosine",
    "list_optimizers", "param_groups", "Precision", "FP32", "TF32", "Autocast", "FP16", "BF16", "Telemetry",
    "Checkpointing", "ActivationCheckpointing",
]

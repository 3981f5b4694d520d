"""A researcher's own package that extends looplib without touching it.

Each class subclasses a looplib base class (or follows a looplib contract) and is selected
either from this package's config directory (``--config-dir examples/my_research/conf
+precision=bf16_fp32_norms``) or by dotted path (``+precision._target_=my_research.BF16FP32Norms``).
"""
from .data import ByteCorpus
from .loss import LabelSmoothedLM
from .model import GRULM
from .optim import Lion, LionFactory
from .precision import BF16FP32Norms

__all__ = ["BF16FP32Norms", "Lion", "LionFactory", "LabelSmoothedLM", "GRULM", "ByteCorpus"]

"""The loss group's former home, kept so that existing ``_target_: looplib.objectives.X`` paths
and imports keep working: the code lives in ``looplib/loss.py`` (config group ``loss``)."""
from .loss import (CausalLMLoss, ChunkedTokenCrossEntropy, LigerTokenCrossEntropy, LinearCrossEntropy,  # noqa: F401
                   SequenceCrossEntropy, TokenCrossEntropy, accepted_inputs, linear_cross_entropy, output_head)

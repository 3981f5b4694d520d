"""A model that runs out of (pretend) CUDA memory above a micro-batch size: for batch_size=auto
tests on the CPU, through the CLI as ``model._target_=fake_oom.GPTThatOOMs +model.oom_above=N``."""
import torch

from looplib.models import GPT


class GPTThatOOMs(GPT):
    def __init__(self, *args, oom_above: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.oom_above = oom_above

    def forward(self, input_ids):
        logits = super().forward(input_ids)  # the graph exists when the error strikes, as in real life
        if input_ids.shape[0] > self.oom_above:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected above {self.oom_above})")
        return logits


class GPTThatDiverges(GPTThatOOMs):
    """Also a NaN loss at one micro-batch size (``nan_at``): for looplib.tune's diverged rows."""

    def __init__(self, *args, nan_at: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.nan_at = nan_at

    def forward(self, input_ids):
        logits = super().forward(input_ids)
        return logits * float("nan") if input_ids.shape[0] == self.nan_at else logits

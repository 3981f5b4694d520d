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

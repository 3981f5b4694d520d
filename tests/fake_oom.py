"""Fakes for tests through the CLI: a model that runs out of (pretend) CUDA memory above a
micro-batch size (``model._target_=fake_oom.GPTThatOOMs +model.oom_above=N``), one that diverges,
one that sleeps in its eager forward, and random data padded per batch."""
import torch

from looplib.data import RandomCorpus
from looplib.data.packing import PadCollate
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


class SleepyGPT(GPT):
    """A GPT whose eager forward also sleeps ``sleep_s``, and ``$LOOPLIB_TEST_SLEEP_S`` more in its
    forward calls numbered ``$LOOPLIB_TEST_SLEEP_CALLS`` (``3-4``; all when unset): looplib.tune's
    test hook slows chosen runs with them. Compiled, the sleep is not traced: ``+compile`` gains a
    known time per step on any machine (looplib.tune's compile tests; on this CPU a tiny model's
    compiled steps gain too little, and too unsteadily, to test with)."""

    def __init__(self, *args, sleep_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        import os
        self.sleep_s, self.extra_s = sleep_s, float(os.environ.get("LOOPLIB_TEST_SLEEP_S", "0"))
        first, _, last = os.environ.get("LOOPLIB_TEST_SLEEP_CALLS", "1-1000000000").partition("-")
        self.slow_calls, self.calls = range(int(first), int(last) + 1), 0

    def compile(self, **options):
        """Dynamo and autograd's tracing without inductor's code generation (``aot_eager``): the
        graphs, recompiles and their count as ``+compile=default`` has them, in a second instead of a
        minute of C++ compiling on a CPU test machine."""
        options.pop("mode", None)
        super().compile(**{**options, "backend": "aot_eager"})

    def forward(self, input_ids, attention_mask=None, **kwargs):  # padded on the right: the mask is not needed
        if not torch.compiler.is_compiling():
            import time
            self.calls += 1
            time.sleep(self.sleep_s + (self.extra_s if self.calls in self.slow_calls else 0.0))
        return super().forward(input_ids, **kwargs)


class PaddedRandom(RandomCorpus):
    """``data=random`` whose sequences have many lengths, each batch padded to its longest (as
    ``data=instruct`` pads): batches change shape, and a compiled model recompiles."""

    def __init__(self, seq_len, vocab_size, n_train=512, n_eval=64, num_classes=0, seed=0):
        super().__init__(seq_len, vocab_size, n_train, n_eval, num_classes, seed)
        self.train, self.eval = Lengths(self.train, seq_len), Lengths(self.eval, seq_len)
        self.pad_id = 0
        self.collate = PadCollate(0)


class Lengths(torch.utils.data.Dataset):
    """Sample i keeps its first 4 + (7 i mod (seq_len - 3)) tokens: lengths 4..seq_len, seeded batches of
    several longest lengths."""

    def __init__(self, data, seq_len):
        self.data, self.seq_len = data, seq_len

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        n = 4 + (7 * i) % (self.seq_len - 3)
        return {k: v[:n] for k, v in self.data[i].items()}

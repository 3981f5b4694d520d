"""The contract every data config group builds (``Corpus``): a train split, a held-out split,
and how tokens turn back into text. The corpora themselves: ``synthetic`` (random tokens),
``pysource`` (the standard library's source), ``files`` (``data=text``), ``records``
(``data=instruct``, ``data=classification``)."""
from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset


class Corpus:
    """What a data config builds: a train split, a held-out split, and how to decode tokens.

    ``train``/``eval``: datasets of dict samples with next-token-shifted ``labels`` (-100: no
    loss); ``collate``: the DataLoader's collate function (None: plain stacking); ``tokenizer``
    (a ``tokenizers.Tokenizer`` or None), ``tokenizer_source`` (the model directory it came
    from, or None), ``vocab_size``, ``eos_id``/``pad_id``, ``label_names`` (classification)."""

    train: Dataset
    eval: Dataset
    vocab_size: int
    collate = None
    tokenizer = None
    tokenizer_source: str | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    label_names: list[str] | None = None

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def sample_prompt(self) -> str:
        """A short prompt from the held-out data (the end-of-run sample, looplib.generate)."""
        if len(self.eval) == 0:
            return ""
        return self.decode(self.eval[0]["input_ids"][:8].tolist())

    chat_records = False  # True: trained on chat messages (the end-of-run sample, looplib.generate template prompts)

    def chat_prompt(self, text: str) -> str:
        """``text`` as the model was trained to see a prompt: a user turn in the tokenizer's chat
        template, opening the assistant's turn, for a model trained on chat records; as it is otherwise."""
        return text

    def fingerprint(self) -> dict | None:
        """What identifies these data, kept in every checkpoint and compared on resume (a change
        is refused: ``looplib.data.identity``): ``{"train": ..., "eval": ..., "tokenizer": ...}``,
        each a digest string or ``{"digest": ..., "files": {path: digest}}``. None (plain
        datasets, random tokens): nothing to compare beyond the config."""
        return None

    def save(self, run_dir: Path) -> None:
        """Write what a run directory needs to read the model's outputs back (labels.json)."""

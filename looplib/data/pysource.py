"""``data=pysource`` (the default): the standard library's own Python source on this machine,
a byte-level BPE trained on it, split by file into train/eval. No download. The tokenizer and
the tokens are cached like any other data's (``tokenizer.train_tokenizer``, ``cache.build``:
``tokenizer-KEY/`` and ``pysource-KEY/`` under ``$LOOPLIB_CACHE``, or ``data.cache_dir``), keyed
by the vocabulary size and the files' names and contents (sha256: about 5 ms for the default 3 MB);
a damaged cache is rebuilt with a warning."""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Annotated

import numpy as np

from ..errors import ConfigError
from ..schema import Positive, Range
from . import identity
from .identity import Expected
from .cache import build as build_cache, cache_key
from .corpus import Corpus
from .packing import TokenWindows
from .readers import file_digests
from .tokenizer import train_tokenizer


class PythonSource(Corpus):
    """The standard library's ``*.py`` files, byte-level BPE, split by file into train/eval (the
    last ``eval_fraction`` of the files, at least one, are held out). Each file ends with the
    end-of-text token; windows of ``seq_len + 1`` ids run across files."""

    def __init__(self, seq_len: Positive[int], vocab_size: Positive[int] = 2048, max_bytes: Positive[int] = 3_000_000,
                 eval_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.05, root: str | None = None,
                 cache_dir: str | None = None, expected: Expected | None = None):
        files = python_files(Path(root or sysconfig.get_paths()["stdlib"]), max_bytes)
        if len(files) < 2:  # one file at least for training, one held out
            raise ConfigError("data.max_bytes", f"{len(files)} Python file(s) under {root or 'the standard library'} "
                              f"within data.max_bytes={max_bytes}: too few to train on and hold one out",
                              "raise data.max_bytes, or point data.root at more Python files")
        where = Path(cache_dir).expanduser() if cache_dir else None  # None: $LOOPLIB_CACHE
        digests = file_digests(files)
        key = cache_key("pysource", vocab_size, [(str(f), d) for f, d in zip(files, digests)])
        n_eval_files = max(1, int(len(files) * eval_fraction))  # (one document per file)
        cut = len(files) - n_eval_files
        self.identity = {"train": identity.part(files[:cut], digests[:cut]),
                         "eval": identity.part(files[cut:], digests[cut:])}
        identity.check(self.identity, expected)  # a resume whose files changed: refused before anything is tokenised

        def texts():
            return (f.read_text(encoding="utf-8", errors="replace") for f in files)

        self.info = train_tokenizer(texts, vocab_size, key, where, expected=expected)
        self.tokenizer, eot = self.info.tokenizer, self.info.eos_id
        self.identity["tokenizer"] = {"digest": self.info.digest, "trained": True, "vocab_size": vocab_size}

        def fill(writer):
            for ids in self.info.encode_batch(list(texts())):
                writer.add(ids + [eot])

        data = build_cache("pysource", cache_key(key, self.info.digest), vocab_size, fill, root=where)
        self.vocab_size = vocab_size
        self.train = TokenWindows(data, np.arange(cut), seq_len)
        self.eval = TokenWindows(data, np.arange(cut, len(data)), seq_len)

    def fingerprint(self):
        return self.identity

    def decode(self, ids):
        return self.tokenizer.decode(list(ids))

    def encode(self, text):
        return self.tokenizer.encode(text).ids

    def sample_prompt(self):
        return "def "


def python_files(root: Path, max_bytes: int) -> list[Path]:
    """Sorted ``*.py`` files of the standard library (tests and site-packages left out)."""
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts) or not path.is_file():
            continue
        files.append(path)
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return files

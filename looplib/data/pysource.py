"""``data=pysource`` (the default): the standard library's own Python source on this machine,
a byte-level BPE trained on it, split by file into train/eval. No download. The tokenizer and
the token stream are cached together under ``$LOOPLIB_CACHE/pysource-KEY/`` (``tokenizer.json``
+ ``tokens.pt``), keyed by the vocabulary size and the files' names and sizes; a damaged cache
is rebuilt."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Annotated

import torch

from ..errors import ConfigError
from ..schema import Positive, Range
from .corpus import Corpus
from .packing import TokenChunks

log = logging.getLogger("looplib")


class PythonSource(Corpus):
    """The standard library's ``*.py`` files, byte-level BPE, split by file into train/eval."""

    def __init__(self, seq_len: Positive[int], vocab_size: Positive[int] = 2048, max_bytes: Positive[int] = 3_000_000,
                 eval_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.05, root: str | None = None,
                 cache_dir: str | None = None):
        files = python_files(Path(root or sysconfig.get_paths()["stdlib"]), max_bytes)
        if len(files) < 2:  # one file at least for training, one held out
            raise ConfigError("data.max_bytes", f"{len(files)} Python file(s) under {root or 'the standard library'} "
                              f"within data.max_bytes={max_bytes}: too few to train on and hold one out",
                              "raise data.max_bytes, or point data.root at more Python files")
        key = hashlib.sha256(repr((vocab_size, [(str(f), f.stat().st_size) for f in files])).encode())
        cache = Path(cache_dir or os.environ.get("LOOPLIB_CACHE", "~/.cache/looplib")).expanduser()
        cache = cache / f"pysource-{key.hexdigest()[:16]}"
        self.tokenizer, tokens, bounds = load_token_cache(cache, files, vocab_size)
        n_eval_files = max(1, int(len(bounds) * eval_fraction))
        split = int(bounds[-n_eval_files - 1])
        self.vocab_size = vocab_size
        self.train = TokenChunks(tokens[:split], seq_len)
        self.eval = TokenChunks(tokens[split:], seq_len)

    def decode(self, ids):
        return self.tokenizer.decode(ids)

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


def load_token_cache(cache: Path, files: list[Path], vocab_size: int):
    """The tokenizer, tokens and file ends cached at ``cache``, built on first use. A cache that
    does not load (a crash mid-copy, a full disk, an edit) is removed and built again, with a
    warning; one that cannot be rebuilt either is an error naming its path."""
    from tokenizers import Tokenizer

    def read():
        tokenizer = Tokenizer.from_file(str(cache / "tokenizer.json"))
        saved = torch.load(cache / "tokens.pt", weights_only=True)
        tokens, bounds = saved["tokens"], saved["file_ends"]
        if tokens.dim() != 1 or bounds.dim() != 1 or not len(bounds) or int(bounds[-1]) != len(tokens):
            raise ValueError("tokens.pt does not hold the token stream it describes")
        return tokenizer, tokens, bounds

    try:
        if not (cache / "tokens.pt").exists():
            build_token_cache(files, vocab_size, cache)
    except OSError as err:
        raise ConfigError("data", f"cannot write the token cache {cache} ({err})",
                          "point LOOPLIB_CACHE (or data.cache_dir) at a writable directory") from None
    try:
        return read()
    except Exception as err:  # noqa: BLE001 - whatever a damaged file raises: rebuild it
        log.warning("the token cache %s is unreadable (%s): removing and rebuilding it", cache,
                    str(err).splitlines()[0] if str(err) else type(err).__name__)
    try:
        shutil.rmtree(cache, ignore_errors=True)
        build_token_cache(files, vocab_size, cache)
        return read()
    except Exception as err:  # noqa: BLE001
        raise ConfigError("data", f"the token cache {cache} is unreadable and could not be rebuilt "
                          f"({str(err).splitlines()[0] if str(err) else type(err).__name__})",
                          f"delete it (rm -r {cache}) or point LOOPLIB_CACHE at a writable directory") from None


def build_token_cache(files: list[Path], vocab_size: int, cache: Path) -> None:
    """Train the tokenizer and tokenise every file once; written atomically (tmp + rename)."""
    from tokenizers import ByteLevelBPETokenizer

    log.info("training a %d-token byte-level BPE tokenizer on %d Python files (cached in %s)",
             vocab_size, len(files), cache)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    eot = tok.token_to_id("<|endoftext|>")
    ids, ends = [], []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids + [eot])
        ends.append(len(ids))
    dtype = torch.int16 if vocab_size <= 32767 else torch.int32
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=cache.name + ".tmp"))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        torch.save({"tokens": torch.tensor(ids, dtype=dtype), "file_ends": torch.tensor(ends)}, tmp / "tokens.pt")
    except BaseException:  # a full disk, a signal: leave no half-written cache behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, cache)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)

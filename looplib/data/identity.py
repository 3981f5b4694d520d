"""A run's identity: what its training data, held-out data and tokenizer were.

A corpus describes them with ``Corpus.fingerprint()``: a dict of parts, ``train``, ``eval`` and
``tokenizer`` (a corpus of one's own may add more), each a digest string or a dict holding one
(``{"digest": ..., "files": {path: digest}}``; ``files`` lets a refusal name what changed).
Every checkpoint keeps the fingerprint of the data it was trained on (meta.json), and a resume
compares it with the data it is given now (``looplib.store.resume``): a difference is refused in
one line (``refuse``), because the checkpoint's weights learned from the old data (a retrained
tokenizer maps text to other ids under the same embeddings).

The command line also compares early: before a run builds its data, ``looplib.run`` reads the
fingerprint of the checkpoint it is about to resume (an ``Expected``) and hands it to the corpus
it builds (the keyword ``expected``, for a corpus class that takes it: ``takes_expected``); the
file corpora then ``check`` their files' digests before they tokenise anything, and a tokenizer
trained on the data is never trained again under a checkpoint: the cache's copy or the
checkpoint's own (``tokenizer.json``) is used, or the resume is refused (``trained_tokenizer``).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path

from ..atomic import make_dir_beside
from ..errors import ConfigError

MAX_LISTED = 10_000   # splits of more files keep one digest, not one per file
WHAT = {"train": "the training data", "eval": "the held-out data", "tokenizer": "the tokenizer",
        "teacher": "the distillation teacher (loss.teacher)",
        "reference": "the DPO reference"}  # the teacher: looplib.distill.Distill.fingerprint
TOKENIZER_FILE = "tokenizer.json"   # a checkpoint's copy of the tokenizer trained on its data


def part(files: list[Path], digests: list[str], **more) -> dict:
    """One split's fingerprint: a digest over every file's (in order) and, for up to
    ``MAX_LISTED`` files, each file's own (to name the ones that changed)."""
    out = {"digest": hashlib.sha256(json.dumps([[str(f), d] for f, d in zip(files, digests)]).encode()).hexdigest(),
           **more}
    if len(files) <= MAX_LISTED:
        out["files"] = {str(f): d for f, d in zip(files, digests)}
    return out


def digest_over(*values) -> str:
    """A digest of plain values (e.g. how a held-out split is drawn from the training files)."""
    return hashlib.sha256(json.dumps(values, default=str).encode()).hexdigest()


def digest_of(value) -> str | None:
    if isinstance(value, dict):
        return None if value.get("digest") is None else str(value["digest"])
    return None if value is None else str(value)


class Expected:
    """The fingerprint of the checkpoint a run is about to resume (or that ``python -m
    looplib.generate`` reads a run's data for: ``key``, ``consequence`` and ``fix`` word its refusal).
    A plain class, not a dataclass: Hydra's ``instantiate`` would read a dataclass handed to a
    corpus as config and convert it to a dict."""

    def __init__(self, fingerprint: dict, checkpoint: Path, key: str = "resume",
                 consequence: str = "so its weights would continue on other data",
                 fix: str = ("put the files back as they were to continue this run, or start a new run in a new "
                             "directory (without resume)")):
        self.fingerprint, self.checkpoint, self.key = fingerprint, Path(checkpoint), key
        self.consequence, self.fix = consequence, fix

    def __repr__(self) -> str:
        return f"Expected(checkpoint={str(self.checkpoint)!r}, key={self.key!r})"

    def get(self, key: str):
        return self.fingerprint.get(key)

    @property
    def tokenizer_copy(self) -> Path | None:
        f = self.checkpoint / TOKENIZER_FILE
        return f if f.is_file() else None


def takes_expected(target) -> bool:
    """Whether a corpus class (or function) takes the keyword ``expected`` (looplib's file corpora
    do; a corpus of one's own may): the builders hand it only to one that does."""
    try:
        return "expected" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


def check(now: dict, e: Expected | None) -> None:
    """Refuse (``ConfigError``) when the parts in ``now`` differ from those of the checkpoint being
    resumed (``e``; None: no resume, nothing to compare)."""
    if e is not None:
        refuse({k: e.get(k) for k in now if k in e.fingerprint}, now, e.checkpoint, e)


def changed(saved: dict | None, now: dict | None) -> list[str]:
    """The parts whose digests differ (both fingerprints known; a part one of them lacks is not compared)."""
    if not saved or not now:
        return []
    keys = [k for k in WHAT if k in saved or k in now] + sorted((set(saved) | set(now)) - set(WHAT))
    return [k for k in keys if k in saved and k in now and digest_of(saved[k]) != digest_of(now[k])]


def refuse(saved: dict | None, now: dict | None, checkpoint: Path, words: Expected | None = None) -> None:
    """One line naming what changed since ``checkpoint`` (the files, where known) and the way out
    (``words``: the setting, consequence and fix to say; a resume's by default)."""
    parts = changed(saved, now)
    if not parts:
        return
    what = [WHAT.get(k, f"the data's {k}") for k in parts]
    named = " and ".join([", ".join(what[:-1]), what[-1]] if len(what) > 1 else what)
    files = file_changes(saved, now, parts)
    words = words or Expected({}, checkpoint)
    raise ConfigError(words.key, f"{named} differ{'s' if len(what) == 1 else ''} from {'that' if len(what) == 1 else 'those'} "
                      f"the checkpoint {checkpoint} was trained on{f' ({files})' if files else ''}, {words.consequence}",
                      words.fix)


def file_changes(saved: dict, now: dict, parts: list[str]) -> str:
    """``in DIR: a.txt edited, b.txt missing, c.txt new`` for the parts that list their files."""
    before, after = {}, {}
    for k in parts:
        if isinstance(saved.get(k), dict) and isinstance(now.get(k), dict) \
                and "files" in saved[k] and "files" in now[k]:
            before.update(saved[k]["files"])
            after.update(now[k]["files"])
    if not before and not after:
        return ""
    groups = (("edited", [f for f in before if f in after and before[f] != after[f]]),
              ("missing", [f for f in before if f not in after]), ("new", [f for f in after if f not in before]))
    names = [f for _, fs in groups for f in fs]
    if not names:
        return ""
    root = os.path.commonpath(names) if len(names) > 1 else os.path.dirname(names[0])
    shown = []
    for word, fs in groups:
        if fs:
            rel = [os.path.relpath(f, root) if root else f for f in fs]
            more = f" and {len(rel) - 3} more" if len(rel) > 3 else ""
            shown.append(f"{', '.join(rel[:3])}{more} {word}")
    return f"in {root}: " + "; ".join(shown) if root else "; ".join(shown)


def trained_tokenizer(target: Path, vocab_size: int, e: Expected | None):
    """Under a resume (``e``: the checkpoint's identity), the tokenizer the run trained on its data,
    never a new one: the cache's copy at ``target`` when it is the run's, else the checkpoint's own
    copy (put back into the cache); None when no resume is expected (``e`` None) or its tokenizer
    was not trained on the data; ``ConfigError`` when neither copy is there."""
    from tokenizers import Tokenizer

    saved = e.get("tokenizer") if e is not None else None
    if not isinstance(saved, dict) or not saved.get("trained") or saved.get("vocab_size") != vocab_size:
        return None  # (another vocabulary size: the config check of the resume names that change)
    for source in (target / TOKENIZER_FILE, e.tokenizer_copy):
        if source is None or not source.is_file():
            continue
        try:
            tok = Tokenizer.from_file(str(source))
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception
            continue
        if tokenizer_digest(tok) != saved.get("digest"):
            continue
        if source != target / TOKENIZER_FILE:
            put_back(source, target)
        return tok
    raise ConfigError("resume", f"the tokenizer this run trained on its data is neither in the cache ({target}) nor "
                      f"in the checkpoint {e.checkpoint}, and a new one would give other token ids to its embeddings",
                      "point LOOPLIB_CACHE (or data.cache_dir) where the run had it, or start a new run in a new "
                      "directory (without resume)")


def tokenizer_digest(tok) -> str:
    """Identifies a ``tokenizers.Tokenizer`` (``TokenizerInfo.digest``)."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


def put_back(source: Path, target: Path) -> None:
    """The checkpoint's copy of the tokenizer into the cache (beside, then renamed; best effort)."""
    import shutil
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_dir_beside(target, target.name + ".tmp")  # (as the umask makes any)
    except OSError:
        return  # a read-only cache: the checkpoint's copy is used all the same
    try:
        shutil.copyfile(source, tmp / TOKENIZER_FILE)
        shutil.rmtree(target, ignore_errors=True)  # (an unreadable or foreign one)
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def checkpoint_files(corpus, fingerprint: dict | None) -> dict[str, bytes]:
    """What every checkpoint carries besides the weights so that a resume needs nothing else of
    the data: the tokenizer trained on it (``tokenizer.json``)."""
    tok = (fingerprint or {}).get("tokenizer")
    if isinstance(tok, dict) and tok.get("trained") and getattr(corpus, "tokenizer", None) is not None:
        return {TOKENIZER_FILE: corpus.tokenizer.to_str().encode()}
    return {}


def read(checkpoint: Path) -> dict | None:
    """The fingerprint a checkpoint's meta.json holds (None: none, or a checkpoint written before
    looplib kept one)."""
    try:
        found = json.loads((Path(checkpoint) / "meta.json").read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) else None

"""The digests of the user's files, read once: an index of what each file was when it was hashed.

A run's identity and its cache keys hash every file's bytes (sha256). Reading every byte at every
start would cost a warm start as much as a cold one with many files, so ``file_digests`` keeps
an index under ``$LOOPLIB_CACHE/index/`` (one per list of files): each file's size, mtime,
ctime and inode when it was hashed, with its digest (and whether it is UTF-8, for plain text
read strictly). A file whose four values are unchanged is not read again; any other is hashed
again. ``file_digests`` holds the list's lock (``lock.py``: ``locks/index-NAME``) while its caller builds the data
(``then``) and writes the index only after that succeeds, so a refused run writes nothing, and
the other ranks of a launch wait, then find every file in the index and read none again.

What the index cannot see: a change that keeps a file's size, mtime, ctime and inode. Setting
the mtime back (``touch -d``, ``os.utime``) changes the ctime, which no user call can set, so
an edit followed by that is still seen. A file changed less than ``RACY_NS`` before it was
hashed is hashed again at the next start (a file system's clock may tick more slowly than
writes come). Writing to the block device under the file system, or a clock set back, is not seen.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import time
from pathlib import Path

from ..errors import ConfigError
from .lock import building

RACY_NS = 2_000_000_000   # an entry is trusted only when its file had not changed for this long when hashed
BLOCK = 1 << 20


def file_digests(files: list[Path], key="data.path", utf8=None, root: Path | None = None, then=None) -> list[str]:
    """The sha256 of each file's bytes (hex). ``utf8(f)``: whether ``f`` must be UTF-8 (refused
    otherwise, before any other work). A file that cannot be read is refused, naming ``key``
    (or ``key(f)``). ``then(digests)``: checks that may refuse them (a resume's identity) before
    the index is written: a refused run writes nothing."""
    from .tokenizer import cache_root

    utf8, then = utf8 or (lambda f: False), then or (lambda digests: None)
    key_of = key if callable(key) else (lambda f: key)
    if not files:
        then([])
        return []
    folder = (root or cache_root()) / "index"
    name = hashlib.sha256("\n".join(map(str, files)).encode()).hexdigest()[:20]
    with building(folder.parent, f"index-{name}", f"the data of {len(files)} files"):  # (one lock per list)
        return indexed(files, key_of, utf8, folder / f"{name}.json", then)


def indexed(files: list[Path], key_of, utf8, path: Path, then) -> list[str]:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        index = {}
    out, changed = [], False
    for f in files:
        try:
            st = os.stat(f)
        except OSError as err:
            raise ConfigError(key_of(f), f"{f} cannot be read ({err.strerror})", f"leave it out of {key_of(f)}") from None
        stat = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        entry = index.get(str(f))
        need = utf8(f)
        if entry is None or entry[:4] != stat or entry[4] - stat[2] < RACY_NS or (need and not entry[6]):
            entry = stat + [time.time_ns(), *hash_file(f, key_of(f), need)]
            index[str(f)], changed = entry, True
        out.append(entry[5])
    then(out)
    if changed:
        try:  # (a read-only cache: hashed again at every start)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({str(f): index[str(f)] for f in files}))
            os.replace(tmp, path)
        except OSError:
            pass
    return out


def hash_file(path: Path, key: str, utf8: bool) -> tuple[str, bool]:
    """The file's sha256 and whether it is UTF-8 (checked when ``utf8``: refused if not)."""
    try:
        with open(path, "rb") as fh:
            return hashed(fh, path, utf8)
    except OSError as err:
        raise ConfigError(key, f"{path} cannot be read ({err.strerror or err})",
                          f"make it readable, or leave it out of {key}") from None


def hashed(fh, path: Path, utf8: bool) -> tuple[str, bool]:
    h, offset = hashlib.sha256(), 0
    decoder = codecs.getincrementaldecoder("utf-8")() if utf8 else None
    while block := fh.read(BLOCK):
        h.update(block)
        if decoder is not None:
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:
                raise not_utf8(path, offset - pending + err.start, err.object[err.start:err.start + 4]) from None
        offset += len(block)
    if decoder is not None:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:
            raise not_utf8(path, offset - len(err.object) + err.start, err.object[err.start:]) from None
    return h.hexdigest(), utf8


def not_utf8(path: Path, at: int, data: bytes) -> ConfigError:
    return ConfigError("data.path", f"{path} is not UTF-8 text (byte {at}: {data!r})",
                       "convert the file to UTF-8, or set data.errors=replace")

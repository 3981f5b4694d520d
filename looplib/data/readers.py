"""Reading the user's files: paths, directories and globs -> documents and records.

Plain text files (``.txt``, ``.md``, ``.py``, ...: anything not listed in ``RECORDS``) are one
document each; JSON Lines, JSON (a list of objects), CSV/TSV and Parquet files hold one record
per line/element/row. The standard library's ``json`` and ``csv`` read the first three: they
stream, know the line number of every record (so a bad line is reported as ``file:line``),
and cost no dependency. Parquet has no reader in the standard library: ``pyarrow`` reads it,
imported only when a ``.parquet`` file is read (``pip install 'looplib[parquet]'``). A directory
that Hugging Face ``datasets`` wrote with ``save_to_disk`` is its Arrow files, in order, one
record per row (``pyarrow`` again; ``pip install 'looplib[datasets]'``).

Every problem is a ``ConfigError`` naming the file, the line (or byte offset) and the setting.
"""
from __future__ import annotations

import csv
import glob
import hashlib
import json
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError, need
from .index import file_digests  # noqa: F401 - (read through an index of sizes and times)

RECORDS = {".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet", ".arrow"}
CHUNK_BYTES = 1 << 20   # plain text is tokenised in pieces of at most this many bytes (``text_pieces``)
SPACES = b" \t\r\x0b\x0c"   # where a line longer than CHUNK_BYTES is cut


def resolve_files(path: str | list[str] | None, key: str = "data.path") -> list[Path]:
    """Files named by ``path``: files, directories (every non-hidden file below, sorted) and
    globs (``**`` recurses), in the order given; each file once."""
    if path is None or path == "" or path == []:
        raise ConfigError(key, "no files given", f"add {key}=FILE, {key}=DIR or {key}='GLOB' (quoted)")
    specs = [path] if isinstance(path, str) else list(path)
    files: list[Path] = []
    for spec in specs:
        spec = str(Path(str(spec)).expanduser())
        if glob.has_magic(spec):
            found = [Path(p) for p in sorted(glob.glob(spec, recursive=True)) if Path(p).is_file()]
        elif Path(spec).is_dir() and saved_dataset(Path(spec), key) is not None:
            found = saved_dataset(Path(spec), key)
        elif Path(spec).is_dir():
            root = Path(spec)
            found = [p for p in sorted(root.rglob("*")) if p.is_file()
                     and not any(part.startswith(".") for part in p.relative_to(root).parts)]
        elif Path(spec).is_file():
            found = [Path(spec)]
        elif not_a_file(Path(spec)):
            raise ConfigError(key, f"{spec} is {not_a_file(Path(spec))}, not a file or directory of data",
                              f"give a regular file (or a directory or glob of them) in {key}: looplib reads its data "
                              "more than once (its fingerprint, then its tokens)")
        else:
            raise ConfigError(key, f"{spec} does not exist", f"give an existing file, directory or glob in {key}")
        if not found:
            raise ConfigError(key, f"{spec} matches no files", f"give a file, a directory holding files, or a glob in {key}")
        files.extend(found)
    return list(dict.fromkeys(p.resolve() for p in files))


def saved_dataset(root: Path, key: str) -> list[Path] | None:
    """The Arrow files of a Hugging Face ``datasets`` directory written by ``save_to_disk`` (its
    ``state.json`` lists them, in the dataset's order), or None for any other directory. A saved
    ``DatasetDict`` (``dataset_dict.json``: one folder per split) is refused naming its splits:
    reading every split would train on the held-out ones."""
    if (root / "dataset_dict.json").is_file():
        try:
            splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError):
            splits = []
        names = ", ".join(map(str, splits)) or "its splits"
        first = splits[0] if splits else "train"
        raise ConfigError(key, f"{root} is a saved DatasetDict of several splits ({names}), not one dataset",
                          f"give one split's folder: {key}={root / str(first)} (and data.eval_path=... for a held-out one)")
    state = root / "state.json"
    if not (state.is_file() and (root / "dataset_info.json").is_file()):
        return None
    try:
        listed = [root / entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(key, f"{state} is not the state file of a saved dataset ({type(err).__name__}: {err})",
                          "save the dataset again (Dataset.save_to_disk)") from None
    missing = [p.name for p in listed if not p.is_file()]
    if missing or not listed:
        raise ConfigError(key, f"{root} is a saved dataset whose files are missing ({', '.join(missing) or 'none listed'})",
                          "save the dataset again (Dataset.save_to_disk)")
    return listed


def not_a_file(path: Path) -> str | None:
    """What ``path`` is when it exists but is neither a regular file nor a directory (a named
    pipe, a socket, a device, a link to nothing), or None."""
    import stat
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "a symbolic link to nothing" if path.is_symlink() else None
    except OSError as err:
        return f"unreadable ({err.strerror})"
    for test, what in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return None


def is_records(path: Path) -> bool:
    return path.suffix.lower() in RECORDS


LINES = {".jsonl", ".ndjson", ".csv", ".tsv"}   # formats with at most one record per line


def document_bound(files: list[Path], enough: int) -> int | None:
    """At most how many documents (plain files, records) ``files`` hold, counted only up to
    ``enough``, without parsing anything: a plain file that is not blank (``blank``) is one, a JSONL file has
    at most a record per line that is not blank, a CSV file one per line after its header. None
    when a file's count is not known that cheaply (JSON, Parquet)."""
    n = 0
    for f in files:
        if n >= enough:
            return n
        suffix = f.suffix.lower()
        if not is_records(f):
            n += not blank(f)
        elif suffix not in LINES:
            return None
        else:
            lines = -1 if suffix in (".csv", ".tsv") else 0
            with open(f, "rb") as fh:
                for line in fh:
                    lines += bool(line.strip())
                    if n + lines >= enough:
                        break
            n += max(lines, 0)
    return n


def content_digest(files: list[Path], digests: list[str] | None = None) -> str:
    """One hash of every file's bytes, in order (the cache key: edit a file, and it re-tokenises);
    ``digests``: the files' ``file_digests``, when already known."""
    h = hashlib.sha256()
    for d in digests if digests is not None else file_digests(files):
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def text_pieces(path: Path, errors: str = "strict") -> Iterator[str]:
    """A plain text file as pieces of at most ``CHUNK_BYTES``, so that memory does not grow with
    the length of a line (the tokenizer holds about 170 bytes per character it encodes at once).
    Each piece is cut where ``cut`` says; a UTF-8 character is never split."""
    offset, data = 0, b""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(CHUNK_BYTES)
            data += block
            while len(data) > CHUNK_BYTES or (not block and data):
                at = len(data) if len(data) <= CHUNK_BYTES else cut(data[:CHUNK_BYTES])
                yield decode(data[:at], path, offset, errors)
                offset, data = offset + at, data[at:]
            if not block:
                return


def cut(data: bytes) -> int:
    """Where to end a piece of text: after its last newline; with none (a long line), before its
    last space, else after its last other whitespace (so a byte-level BPE splits the text into
    the same words either way: a space goes with the word after it); else before the first byte
    of its last UTF-8 character (continuation bytes are 0b10xxxxxx). Never 0."""
    at = data.rfind(b"\n") + 1 or max(data.rfind(b" "), 0) or max(data.rfind(bytes([b])) for b in SPACES[1:]) + 1
    if at:
        return at
    at = len(data) - 1
    while at > 0 and data[at] & 0xC0 == 0x80 and len(data) - at < 4:
        at -= 1
    return at or len(data)


def blank(path: Path) -> bool:
    """Whether a file holds nothing but ASCII whitespace (read up to its first other byte)."""
    with open(path, "rb") as fh:
        while block := fh.read(1 << 16):
            if block.strip():
                return False
    return True


def decode(data: bytes, path: Path, offset: int, errors: str, where: str = "") -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise ConfigError("data.path", f"{path}{where} is not UTF-8 text (byte {offset + err.start}: "
                          f"{data[err.start:err.start + 4]!r})",
                          "convert the file to UTF-8, or set data.errors=replace") from None


def records(path: Path, errors: str = "strict") -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for each record of a JSONL/JSON/CSV/TSV/Parquet file; ``where`` is
    ``file:line`` (or ``file[i]``, ``file row i``) for error messages."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        yield from jsonl_records(path, errors)
    elif suffix == ".json":
        yield from json_records(path, errors)
    elif suffix in (".csv", ".tsv"):
        yield from csv_records(path, errors, "\t" if suffix == ".tsv" else ",")
    elif suffix == ".parquet":
        yield from parquet_records(path)
    elif suffix == ".arrow":
        yield from arrow_records(path)
    else:
        raise ConfigError("data.path", f"{path} is plain text, not records", "give JSONL, JSON, CSV or Parquet files")


def jsonl_records(path: Path, errors: str) -> Iterator[tuple[str, dict]]:
    offset = 0
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            line = decode(raw, path, offset, errors, f" line {number}")
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError("data.path", f"{path}:{number} is not JSON ({err.msg} at column {err.colno})",
                                  "write one JSON object per line") from None
            yield check_object(record, f"{path}:{number}")


def json_records(path: Path, errors: str) -> Iterator[tuple[str, dict]]:
    text = decode(path.read_bytes(), path, 0, errors)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError("data.path", f"{path}:{err.lineno} is not JSON ({err.msg} at column {err.colno})",
                          "fix the file, or write JSON Lines (.jsonl): one object per line") from None
    if not isinstance(data, list):
        raise ConfigError("data.path", f"{path} holds a JSON {type(data).__name__}, not a list of records",
                          "write a JSON list of objects, or JSON Lines (.jsonl)")
    for i, record in enumerate(data):
        yield check_object(record, f"{path}[{i}]")


def csv_records(path: Path, errors: str, delimiter: str) -> Iterator[tuple[str, dict]]:
    def lines():
        offset = 0
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                yield decode(raw, path, offset, errors, f" line {number}")
                offset += len(raw)

    reader = csv.DictReader(lines(), delimiter=delimiter)
    try:
        for row in reader:
            yield f"{path}:{reader.line_num}", row
    except csv.Error as err:
        raise ConfigError("data.path", f"{path}:{reader.line_num} is not valid CSV ({err})", "fix the file") from None


def parquet_records(path: Path) -> Iterator[tuple[str, dict]]:
    pq = need("pyarrow.parquet", "parquet", "data.path", f"{path} is Parquet; reading it")
    try:
        table = pq.ParquetFile(path)
        row = 0
        for batch in table.iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                yield f"{path} row {row}", record
                row += 1
    except (OSError, ValueError) as err:  # pyarrow.ArrowInvalid is a ValueError
        raise ConfigError("data.path", f"{path} is not a readable Parquet file ({err})", "fix the file") from None


def arrow_batches(path: Path, key: str = "data.path"):
    """The record batches of an Arrow file as ``datasets`` writes them (the IPC stream format; the
    file format too), read with ``pyarrow`` (``pip install 'looplib[datasets]'``) as they stream."""
    pa = need("pyarrow", "datasets", key, f"{path} is an Arrow file of a saved dataset; reading it")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
        reader = pa.ipc.open_file(path) if magic == b"ARROW1" else pa.ipc.open_stream(path)
        if hasattr(reader, "num_record_batches") and magic == b"ARROW1":
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
        else:
            yield from reader
    except (OSError, ValueError) as err:  # pyarrow.ArrowInvalid is a ValueError
        raise ConfigError(key, f"{path} is not a readable Arrow file ({err})", "save the dataset again") from None


def arrow_records(path: Path) -> Iterator[tuple[str, dict]]:
    row = 0
    for batch in arrow_batches(path):
        for record in batch.to_pylist():
            yield f"{path} row {row}", record
            row += 1


def check_object(record, where: str) -> tuple[str, dict]:
    if not isinstance(record, dict):
        raise ConfigError("data.path", f"{where} is a JSON {type(record).__name__}, not an object",
                          'write records as objects, e.g. {"text": "..."}')
    return where, record


def field(record: dict, name: str, where: str, key: str):
    """``record[name]``; a missing field names the setting and lists the fields present."""
    try:
        return record[name]
    except KeyError:
        present = ", ".join(map(str, record)) or "none"
        raise ConfigError(key, f"{where} has no field {name!r} (fields: {present})",
                          f"set {key}=NAME to the field that holds it") from None


def text_field(record: dict, name: str, where: str, key: str) -> str:
    value = field(record, name, where, key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(key, f"{where}: field {name!r} holds {type(value).__name__}, not text",
                          f"set {key} to a field holding text")
    return value

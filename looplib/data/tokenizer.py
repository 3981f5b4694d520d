"""The tokenizer: a model directory's own (``data.tokenizer=DIR`` or a ``tokenizer.json``), or a
byte-level BPE trained on the user's files and cached (``data.tokenizer=null``).

``tokenizers`` loads ``tokenizer.json`` directly (fast, no transformers). transformers is
imported only where it is needed: a model directory without ``tokenizer.json`` (e.g. a
SentencePiece ``tokenizer.model``: ``AutoTokenizer`` converts it), and chat records rendered
with the directory's chat template.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable


from ..atomic import make_dir_beside
from ..errors import ConfigError, need
from .identity import Expected, tokenizer_digest, trained_tokenizer
from .lock import building
from .progress import progress

log = logging.getLogger("looplib")

EOT = "<|endoftext|>"
EOS_NAMES = (EOT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
TRAIN_BYTES = 200 << 20  # a BPE is trained on at most this much text (the first documents)
# The trainer sees no word (run of non-whitespace) longer than this: longer runs reach it cut into
# pieces of MAX_WORD characters. Its time grows with the square of a word's length (measured with
# tokenizers 0.23 on 4 MB of one repeated character: 0.2 s for words of 1,000 characters, 0.4 s
# for 10,000, 15 s for 100,000, over 240 s for one 4 MB word), so this bounds it on any text.
MAX_WORD = 4096
LONG_WORD = re.compile(r"(\S{%d})" % MAX_WORD)


def cache_root() -> Path:
    return Path(os.environ.get("LOOPLIB_CACHE", "~/.cache/looplib")).expanduser()


@dataclass
class TokenizerInfo:
    """A ``tokenizers.Tokenizer`` and what the corpora need to know about it."""
    tokenizer: object
    source: str | None = None          # the model directory it came from (None: trained here)
    eos_id: int | None = None
    pad_id: int | None = None
    prefix: list[int] = field(default_factory=list)   # what add_special_tokens puts before a text (BOS, [CLS])
    suffix: list[int] = field(default_factory=list)   # ... and after it ([SEP])
    chat_template: str | None = None
    trained_now: Path | None = None    # the cache entry this process trained it into (removed if the run is refused)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def digest(self) -> str:
        """Identifies the tokenisation (the token cache's key, the run's identity)."""
        return tokenizer_digest(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """A prompt's ids as the model saw texts start in training (with the BOS, if any)."""
        return self.prefix + self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)  # fast: no offsets
        return [e.ids for e in encode(texts, add_special_tokens=False)]


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> TokenizerInfo:
    """From a model directory or a ``tokenizer.json`` file."""
    from tokenizers import Tokenizer

    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(key, f"{spec} does not exist", f"give a model directory or a tokenizer.json in {key} "
                          "(null: train a tokenizer on the files)")
    directory = path if path.is_dir() else path.parent
    settings = read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").exists() else {}
    file = path if path.is_file() else path / "tokenizer.json"
    if file.is_file():
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ConfigError(key, f"{file} is not a tokenizer ({err})", "give a tokenizers tokenizer.json") from None
    else:
        tok = transformers_tokenizer(path, key)
    info = TokenizerInfo(tok, source=str(directory.resolve()) if path.is_dir() else None,
                         chat_template=chat_template(directory, settings) if path.is_dir() else None)
    info.eos_id = special_id(tok, settings.get("eos_token"), EOS_NAMES)
    info.pad_id = special_id(tok, settings.get("pad_token"), ()) if settings.get("pad_token") else None
    if info.pad_id is None:
        info.pad_id = info.eos_id if info.eos_id is not None else 0
    info.prefix, info.suffix = specials(tok)
    return info


def transformers_tokenizer(path: Path, key: str):
    """A directory without tokenizer.json: transformers' fast tokenizer (converted from a slow one)."""
    if not path.is_dir():
        raise ConfigError(key, f"{path} is not a tokenizer.json", "give a model directory or a tokenizer.json")
    transformers = need("transformers", "hf", key, f"{path} has no tokenizer.json; reading its tokenizer")
    transformers.logging.set_verbosity_error()
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds
        raise ConfigError(key, f"{path} holds no tokenizer ({str(err).splitlines()[0]})",
                          "give a model directory with tokenizer files, or data.tokenizer=null") from None
    if getattr(hf, "backend_tokenizer", None) is None:
        raise ConfigError(key, f"{path}'s tokenizer has no fast (tokenizers) version", "save it with a tokenizer.json")
    return hf.backend_tokenizer


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError("data.tokenizer", f"{path} does not read as JSON ({err})", "fix or remove the file") from None


def chat_template(directory: Path, settings: dict) -> str | None:
    """The directory's chat template: chat_template.jinja, or tokenizer_config.json's chat_template."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template or None


def special_id(tok, token, fallbacks: Iterable[str]) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    for name in ([token] if token else []) + list(fallbacks):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def specials(tok) -> tuple[list[int], list[int]]:
    """The ids ``add_special_tokens=True`` puts before and after a text (e.g. ``[BOS]``, or
    ``[CLS]`` and ``[SEP]``), found by encoding one word both ways."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return [], []


def train_tokenizer(texts: Callable[[], Iterable[str]], vocab_size: int, key: str,
                    root: Path | None = None, nothing: ConfigError | None = None, total_bytes: int = 0,
                    expected: Expected | None = None) -> TokenizerInfo:
    """A byte-level BPE (``<|endoftext|>`` as its one special token) trained on ``texts()``,
    cached under ``ROOT/tokenizer-KEY/`` (``root`` default ``$LOOPLIB_CACHE``; written to a
    temporary directory, then renamed). A cached file that does not load is trained again,
    except under a resume (``expected``: the identity of the checkpoint it continues from): then
    the run's own tokenizer is used or the resume refused (``identity.trained_tokenizer``). ``texts()`` that hold no text (empty or blank files) are
    refused (``nothing``, or a line of its own) before a tokenizer trained on nothing is cached.
    ``total_bytes``: the size of the text, for the progress bar (or lines) of a large one."""
    if vocab_size < 257:
        raise ConfigError("data.vocab_size", f"a byte-level BPE needs more than 256 tokens (got {vocab_size})",
                          "use e.g. data.vocab_size=8192")
    target = (root or cache_root()) / f"tokenizer-{key}"
    resumed = trained_tokenizer(target, vocab_size, expected)  # a resume: the run's own, never a new one
    if resumed is not None:
        return TokenizerInfo(resumed, source=None, eos_id=resumed.token_to_id(EOT), pad_id=resumed.token_to_id(EOT))
    cached = cached_tokenizer(target)
    if cached is not None:
        return cached
    with building(target.parent, target.name, f"the tokenizer {target}"):  # one trainer; the others wait, then load it
        return cached_tokenizer(target) or trained(texts, vocab_size, target, nothing, total_bytes)


def cached_tokenizer(target: Path) -> TokenizerInfo | None:
    """The tokenizer cached at ``target``, or None (one that does not load is removed)."""
    from tokenizers import Tokenizer

    if (target / "tokenizer.json").is_file():
        try:
            tok = Tokenizer.from_file(str(target / "tokenizer.json"))
            return TokenizerInfo(tok, source=None, eos_id=tok.token_to_id(EOT), pad_id=tok.token_to_id(EOT))
        except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception
            log.warning("the cached tokenizer %s is unreadable (%s): training it again", target,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            shutil.rmtree(target, ignore_errors=True)
    return None


def trained(texts: Callable[[], Iterable[str]], vocab_size: int, target: Path, nothing, total_bytes: int) -> TokenizerInfo:
    from tokenizers import ByteLevelBPETokenizer, Tokenizer

    found = []

    def limited():
        with progress(min(total_bytes, TRAIN_BYTES), "reading text for the tokenizer") as bar:
            yield from cut_words(texts(), bar)

    def cut_words(texts, bar):
        seen = 0
        for text in texts:
            bar.update(len(text))
            if not found and text.strip():
                found.append(True)
            if len(text) > MAX_WORD and LONG_WORD.search(text):
                yield from (part for part in LONG_WORD.split(text) if part)  # each its own sequence
            else:
                yield text
            seen += len(text)
            if seen >= TRAIN_BYTES:
                return

    log.info("training a byte-level BPE tokenizer of up to %d tokens on the data (cached in %s)", vocab_size, target)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(limited(), vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                            show_progress=sys.stderr.isatty())  # (its own bar: counting words, then merges)
    if not found:  # nothing to learn from: no tokenizer of 257 bytes goes into the cache
        raise nothing or ConfigError("data.path", "the data holds no text to train a tokenizer on (every file or "
                                     "record is empty)", "give files with text in them")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_dir_beside(target, target.name + ".tmp")
    except OSError as err:
        raise ConfigError("data", f"cannot write the tokenizer cache {target} ({err})",
                          "point LOOPLIB_CACHE (or data.cache_dir) at a writable directory") from None
    ours = None
    try:
        bpe.save(str(tmp / "tokenizer.json"))
        os.rename(tmp, target)
        ours = target
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    if tok.get_vocab_size() < vocab_size:  # a small corpus has fewer merges to learn than asked for
        log.info("the tokenizer learned %d tokens (the data held no more pairs seen twice); the model keeps %d "
                 "embeddings, %d never used", tok.get_vocab_size(), vocab_size, vocab_size - tok.get_vocab_size())
    return TokenizerInfo(tok, source=None, eos_id=eot, pad_id=eot, trained_now=ours)


def tokenizer_size(spec, default: int) -> int:
    """Resolver ``${looplib.vocab_size:${.tokenizer},N}``: the tokenizer's size when the data
    names one (so the model's embeddings follow it), else ``N`` (the size of the BPE to train).
    A tokenizer that does not load resolves to ``N``: the corpus then says what is wrong."""
    if spec is None:
        return int(default)
    try:
        return load_tokenizer(str(spec)).vocab_size
    except Exception:  # noqa: BLE001 - reported properly when the corpus loads it
        return int(default)


class ChatTemplate:
    """Renders chat ``messages`` with a model directory's chat template through transformers'
    ``apply_chat_template`` (imported only for chat records) and splits the text into
    (text, is_assistant) segments: an assistant turn is what rendering up to and including it
    adds to rendering the turns before it with the generation prompt."""

    def __init__(self, info: TokenizerInfo | None, key: str):
        if info is None or info.chat_template is None or info.source is None:
            raise ConfigError(key, "the records hold chat messages, but the tokenizer has no chat template",
                              "set data.tokenizer to a model directory whose tokenizer has one, "
                              "or write prompt/completion records")
        transformers = need("transformers", "hf", key, "rendering the chat template of chat records")
        transformers.logging.set_verbosity_error()
        self.hf = transformers.AutoTokenizer.from_pretrained(info.source, local_files_only=True)
        self.hf.chat_template = info.chat_template
        self.key = key

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def segments(self, messages, where: str) -> list[tuple[str, bool]]:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ConfigError(self.key, f"{where}: messages must be a list of {{role, content}} objects",
                              'e.g. [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]')
        text = self.render(messages)
        cuts, done = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], generation_prompt=True) if i else ""
            upto = self.render(messages[:i + 1])
            if not (upto.startswith(before) and text.startswith(upto) and len(before) >= done):
                raise ConfigError(self.key, f"{where}: the chat template does not render earlier turns as a prefix "
                                  "of the whole conversation, so the assistant tokens cannot be found",
                                  "write prompt/completion records instead")
            cuts.append((len(before), len(upto)))
            done = len(upto)
        if not cuts:
            raise ConfigError(self.key, f"{where}: the conversation has no assistant message (nothing to learn)",
                              "add an assistant turn to every conversation")
        parts, at = [], 0
        for start, stop in cuts:
            parts += [(text[at:start], False), (text[start:stop], True)]
            at = stop
        parts.append((text[at:], False))
        return [p for p in parts if p[0]]

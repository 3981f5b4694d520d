"""Data: from the user's files (or random tokens, or the standard library's source) to batches.

One module per concern:

- ``readers``: paths, directories and globs -> documents and records (text, JSONL, JSON, CSV, Parquet)
- ``tokenizer``: a model directory's tokenizer, or a byte-level BPE trained on the files
- ``cache``: tokenise once into a memory-mapped cache under ``$LOOPLIB_CACHE``
- ``packing``: next-token labels, windows, examples, packing, padding (collate)
- the corpora the data config groups build: ``corpus`` (the contract), ``synthetic`` (``data=random``),
  ``pysource`` (``data=pysource``), ``files`` (``data=text``), ``records`` (``data=instruct|classification``),
  ``preference`` (``data=preference``: prompt, chosen and rejected completions),
  ``prompts`` (``data=prompts``: prompts to sample from, with the fields a reward reads),
  ``tokens`` (``data=tokens``: ids brought ready-made)
- ``lock``: one builder per cache entry; ``index``: the files' digests, read again only when they change;
  ``progress``: bars and lines while data is built
- ``loading``: the seeded, resumable sampler, the epoch stream, the DataLoader, the held-out set
- ``identity``: what a run was trained on (``Corpus.fingerprint``), compared on resume
"""
from .corpus import Corpus
from .files import FileCorpus, TextCorpus
from .pysource import PythonSource, python_files
from .records import ClassificationCorpus, InstructCorpus
from .synthetic import RandomCorpus, RandomTokens
from .tokens import TokenCorpus
from .loading import EpochSampler, Epochs, HeldOut, build_loader, held_out
from .packing import (IGNORE, Examples, Packed, PadCollate, Sequences, TokenChunks, TokenWindows, next_token_example,
                      shift_labels)


__all__ = ["ClassificationCorpus", "Corpus", "EpochSampler", "Epochs", "Examples", "FileCorpus", "HeldOut", "IGNORE",
           "InstructCorpus", "Packed", "PadCollate", "PythonSource", "RandomCorpus", "RandomTokens", "Sequences",
           "TextCorpus", "TokenChunks", "TokenCorpus", "TokenWindows", "build_loader", "held_out",
           "next_token_example", "shift_labels",
           "python_files"]

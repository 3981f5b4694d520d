"""A tiny pretrained-model directory made on this machine, no download:
``python -m looplib.make_tiny_model DIR [--text FILES_OR_DIRS ...]``.

Trains a byte-level BPE tokenizer (``tokenizers``) on local text (default: some of the Python
standard library's source), and ``save_pretrained``s a small randomly initialised
``LlamaForCausalLM`` with that tokenizer (``PreTrainedTokenizerFast``, a chat template
included) into DIR: a directory ``model=hf model.path=DIR`` fine-tunes and
``AutoModelForCausalLM.from_pretrained(DIR)`` loads, as a real checkpoint would be.
For tests, walkthroughs and trying the commands out; needs ``pip install 'looplib[hf]'``.
"""
from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

EOT, PAD = "<|endoftext|>", "<|pad|>"
# role headers, then the content and the end-of-text token: data=instruct renders chat
# messages with it (add_generation_prompt opens the assistant's turn)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}" + EOT + "\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def text_files(paths: list[str], max_bytes: int) -> list[Path]:
    from .data import python_files
    if not paths:
        return python_files(Path(sysconfig.get_paths()["stdlib"]), max_bytes)
    files = []
    for p in map(Path, paths):
        files.extend(sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p])
    return files


def make_tiny_model(directory: str | Path, texts: list[str] | None = None, vocab_size: int = 1024,
                    hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    max_positions: int = 512, max_bytes: int = 400_000, seed: int = 0) -> Path:
    """Write the tokenizer and a random tiny Llama into ``directory``; return it."""
    import torch
    from tokenizers import ByteLevelBPETokenizer

    from .hf import import_transformers
    import_transformers()  # quiet: no progress bars
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    files = text_files(texts or [], max_bytes)
    corpus = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    if not any(corpus):
        raise SystemExit(f"make_tiny_model: no text in {texts}")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT, PAD],
                            show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=EOT, eos_token=EOT,
                                        pad_token=PAD, model_max_length=max_positions)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size + 8,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m looplib.make_tiny_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--text", nargs="*", default=[], help="files or directories to train the tokenizer on "
                        "(default: the Python standard library's source)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_tiny_model(args.directory, args.text, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                          layers=args.layers, max_positions=args.max_positions, seed=args.seed)
    n = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote a tiny Llama and its tokenizer to {out} ({n / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

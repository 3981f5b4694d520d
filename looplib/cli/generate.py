"""Sample from a run's result: ``python -m looplib.generate RUN_DIR [--prompt TEXT] [--tokens N]``.

The arguments and the sampling only: what a run left is loaded by ``looplib.store.finished``
(``load_finished``, which the Python API calls too):

- a run of a transformers model (``model=hf``, ``llama_tiny`` ...): its ``hf/`` directory, its own
  tokenizer; a classifier prints its class probabilities for the prompt instead;
- a run of a bundled model (GPT): ``config.yaml`` + ``model.safetensors``, the tokenizer from
  the data config (the corpus cache under ``$LOOPLIB_CACHE``);
- a run stopped before its end (preempted): its newest checkpoint, named on stderr (or a
  checkpoint given itself: ``RUN_DIR/checkpoints/step-N``).

Without ``--prompt`` the prompt comes from the run's held-out data (``corpus.sample_prompt()``).
A model trained on chat records (``data=instruct`` with ``messages``) is prompted as it was
trained: ``--prompt`` becomes a user turn in the tokenizer's chat template, the assistant's turn
opened, and sampling stops at the end of that turn (``--raw``: the prompt as it is).
Nothing is downloaded. Bad input: one line, exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..errors import EXIT_CONFIG, ConfigError
from ..store.finished import Finished, load_finished, run_config, run_corpus


def default_prompt(run_dir: Path, prompt: str | None, raw: bool = False) -> tuple[str, bool]:
    """(the prompt, whether the model is a chat model prompted through its template)."""
    chat_data = run_config(run_dir).get("data", {}).get("_target_", "").endswith("InstructCorpus")
    if prompt is not None and (raw or not chat_data):
        return prompt, False
    try:
        corpus = run_corpus(run_dir)
    except Exception as err:  # noqa: BLE001 - files moved, cache gone: the user can still say
        if prompt is not None:
            print(f"looplib: the run's data does not load ({' '.join(str(err).split())[:200]}): the prompt goes "
                  "to the model as it is, not in a chat template", file=sys.stderr)
            return prompt, False
        raise ConfigError("--prompt", f"no prompt given, and the run's data does not load ({err})",
                          'give one: --prompt "..."') from None
    chat = bool(getattr(corpus, "chat_records", False)) and not raw
    if prompt is not None:
        return (corpus.chat_prompt(prompt) if chat else prompt), chat
    if corpus is None or not hasattr(corpus, "sample_prompt"):
        raise ConfigError("--prompt", "no prompt given and the run's data has none to offer",
                          'give one: --prompt "..."')
    return corpus.sample_prompt(), chat


def generate_hf(done: Finished, prompt: str | None, args, device: torch.device) -> str:
    model, tokenizer = done.model, done.tokenizer
    prompt, chat = default_prompt(done.run_dir, prompt, args.raw)
    # a templated prompt holds its special tokens as text: the template's own BOS, nothing added
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not chat).to(device)
    if done.classifier:
        with torch.no_grad():
            probs = model(**inputs).logits.float().softmax(-1)[0]
        labels = model.config.id2label
        return "\n".join(f"{labels.get(i, i)}\t{p:.4f}" for i, p in sorted(enumerate(probs.tolist()),
                                                                          key=lambda x: -x[1]))
    torch.manual_seed(args.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop = {"eos_token_id": tokenizer.eos_token_id} if chat and tokenizer.eos_token_id is not None else {}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.tokens, do_sample=True, top_k=args.top_k,
                             temperature=args.temperature, pad_token_id=pad, **stop)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def generate_bundled(done: Finished, prompt: str | None, args, device: torch.device) -> str:
    model = done.model
    if not hasattr(model, "generate"):
        raise ConfigError("RUN_DIR", f"the run's model ({type(model).__name__}) has no generate()",
                          "sample from a language model's run")
    corpus = done.corpus()
    chat = bool(getattr(corpus, "chat_records", False)) and not args.raw
    if prompt is None:
        prompt = corpus.sample_prompt() if hasattr(corpus, "sample_prompt") else "\n"
    elif chat:
        prompt = corpus.chat_prompt(prompt)
    ids = torch.tensor([corpus.encode(prompt)], device=device)
    gen = torch.Generator(device).manual_seed(args.seed)
    stop = {"stop": corpus.eos_id} if chat and corpus.eos_id is not None else {}
    with torch.no_grad():
        out = model.generate(ids, args.tokens, temperature=args.temperature, top_k=args.top_k, generator=gen, **stop)
    return corpus.decode(out[0].tolist())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m looplib.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or a transformers model directory)")
    parser.add_argument("--prompt", default=None, help="text to continue (default: one from the held-out data)")
    parser.add_argument("--tokens", type=int, default=100, help="tokens to generate (default 100)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    parser.add_argument("--raw", action="store_true",
                        help="a model trained on chat records: the prompt as it is, not a user turn in its template")
    args = parser.parse_args(argv)
    try:
        from ..engines.local import resolve_device
        device = resolve_device(args.device)
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            raise ConfigError("RUN_DIR", f"{run_dir} is not a directory", "give a run directory (outputs/DATE/TIME)")
        if args.tokens < 1 or args.temperature <= 0 or args.top_k < 1:
            raise ConfigError("--tokens", "--tokens and --top-k must be at least 1, --temperature positive",
                              "e.g. --tokens 100 --temperature 0.8 --top-k 40")
        done = load_finished(run_dir, device)
        if done.checkpoint is not None and done.checkpoint != run_dir:
            print(f"looplib: {run_dir} was stopped before its end: sampling from its newest checkpoint, "
                  f"{done.checkpoint}", file=sys.stderr, flush=True)
        sample = generate_hf if done.tokenizer is not None else generate_bundled
        text = sample(done, args.prompt, args, device)
    except ConfigError as err:
        print(f"looplib: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    print(text)
    return 0

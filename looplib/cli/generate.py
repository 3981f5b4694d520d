"""Sample from a run's result: ``python -m looplib.generate RUN_DIR [--prompt TEXT] [--tokens N]``.

- A run of a transformers model (``model=hf``, ``llama_tiny`` ...): its ``hf/`` directory (or any
  directory ``save_pretrained`` wrote), loaded with transformers (``peft`` for a LoRA adapter)
  and its own tokenizer; a classifier prints its class probabilities for the prompt instead.
- A run of a bundled model (GPT): ``config.yaml`` + ``model.safetensors``, the tokenizer from
  the data config (the corpus cache under ``$LOOPLIB_CACHE``).

Without ``--prompt`` the prompt comes from the run's held-out data (``corpus.sample_prompt()``).
Nothing is downloaded. Bad input: one line, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..errors import EXIT_CONFIG, ConfigError


def hf_directory(run_dir: Path) -> Path | None:
    for candidate in (run_dir / "hf", run_dir):
        if (candidate / "config.json").is_file() or (candidate / "adapter_config.json").is_file():
            return candidate
    return None


def run_corpus(run_dir: Path):
    """The run's data, rebuilt from its config.yaml (tokenised once: the cache answers)."""
    import hydra
    from omegaconf import OmegaConf
    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    return hydra.utils.instantiate(OmegaConf.load(config).data)


def default_prompt(run_dir: Path, prompt: str | None) -> str:
    if prompt is not None:
        return prompt
    try:
        corpus = run_corpus(run_dir)
    except Exception as err:  # noqa: BLE001 - files moved, cache gone: the user can still say
        raise ConfigError("--prompt", f"no prompt given, and the run's data does not load ({err})",
                          'give one: --prompt "..."') from None
    if corpus is None or not hasattr(corpus, "sample_prompt"):
        raise ConfigError("--prompt", "no prompt given and the run's data has none to offer",
                          'give one: --prompt "..."')
    return corpus.sample_prompt()


def load_hf(directory: Path, device: torch.device):
    """(model, tokenizer, is_classifier) from a transformers or peft directory, local files only."""
    from ..hf import import_transformers
    transformers = import_transformers()
    adapter = directory / "adapter_config.json"
    if adapter.is_file():
        from ..peft import import_peft
        peft = import_peft()
        task = json.loads(adapter.read_text()).get("task_type")
        auto = peft.AutoPeftModelForSequenceClassification if task == "SEQ_CLS" else peft.AutoPeftModelForCausalLM
        classifier = task == "SEQ_CLS"
    else:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
        auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModelForCausalLM
    from ..hf import has_tokenizer
    if not has_tokenizer(directory):
        raise ConfigError("RUN_DIR", f"{directory} holds no tokenizer (the run's data had none, e.g. data=random)",
                          "train on text data (data=text, data=instruct) to sample text")
    try:
        model = auto.from_pretrained(str(directory), local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError("RUN_DIR", f"{directory} does not load: {' '.join(str(err).split())[:300]}",
                          "give a run directory of a finished run (it holds hf/)") from None
    return model.to(device).eval(), tokenizer, classifier


def generate_hf(directory: Path, prompt: str | None, args, device: torch.device) -> str:
    model, tokenizer, classifier = load_hf(directory, device)
    prompt = default_prompt(directory.parent if directory.name == "hf" else directory, prompt)
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    if classifier:
        with torch.no_grad():
            probs = model(**inputs).logits.float().softmax(-1)[0]
        labels = model.config.id2label
        return "\n".join(f"{labels.get(i, i)}\t{p:.4f}" for i, p in sorted(enumerate(probs.tolist()),
                                                                          key=lambda x: -x[1]))
    torch.manual_seed(args.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.tokens, do_sample=True, top_k=args.top_k,
                             temperature=args.temperature, pad_token_id=pad)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def generate_bundled(run_dir: Path, prompt: str | None, args, device: torch.device) -> str:
    import hydra
    from omegaconf import OmegaConf
    from safetensors.torch import load_model
    weights = run_dir / "model.safetensors"
    if not weights.is_file() or not (run_dir / "config.yaml").is_file():
        if (run_dir / "adapter").is_dir():
            raise ConfigError("RUN_DIR", f"{run_dir} holds a LoRA adapter of a bundled model, not its weights",
                              "sample at the end of the run (sample_tokens=N), or load it with looplib.load_lora")
        raise ConfigError("RUN_DIR", f"{run_dir} holds neither hf/ nor config.yaml + model.safetensors",
                          "give the directory of a finished run (outputs/DATE/TIME)")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    model = hydra.utils.instantiate(cfg.model)
    load_model(model, str(weights))
    model.to(device).eval()
    corpus = hydra.utils.instantiate(cfg.data)
    prompt = prompt if prompt is not None else (corpus.sample_prompt() if hasattr(corpus, "sample_prompt") else "\n")
    ids = torch.tensor([corpus.encode(prompt)], device=device)
    gen = torch.Generator(device).manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(ids, args.tokens, temperature=args.temperature, top_k=args.top_k, generator=gen)
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
        directory = hf_directory(run_dir)
        if directory is not None:
            text = generate_hf(directory, args.prompt, args, device)
        else:
            text = generate_bundled(run_dir, args.prompt, args, device)
    except ConfigError as err:
        print(f"looplib: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    print(text)
    return 0


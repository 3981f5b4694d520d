"""Sample from a run's result: ``python -m looplib.generate RUN_DIR [--prompt TEXT] [--tokens N]``.

- A run of a transformers model (``model=hf``, ``llama_tiny`` ...): its ``hf/`` directory (or any
  directory ``save_pretrained`` wrote), loaded with transformers (``peft`` for a LoRA adapter)
  and its own tokenizer; a classifier prints its class probabilities for the prompt instead.
- A run of a bundled model (GPT): ``config.yaml`` + ``model.safetensors``, the tokenizer from
  the data config (the corpus cache under ``$LOOPLIB_CACHE``).

Without ``--prompt`` the prompt comes from the run's held-out data (``corpus.sample_prompt()``).
A model trained on chat records (``data=instruct`` with ``messages``) is prompted as it was
trained: ``--prompt`` becomes a user turn in the tokenizer's chat template, the assistant's turn
opened, and sampling stops at the end of that turn (``--raw``: the prompt as it is). A QLoRA
run's adapter is loaded on its base quantised to 4 bits as it trained (bitsandbytes).
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
    """The run's data, rebuilt from its config.yaml (tokenised once: the cache answers), held to
    the identity its newest checkpoint recorded: data changed since the run trained are refused
    (a tokenizer trained on them would give other ids to its embeddings), and a tokenizer the run
    trained is never trained again (the cache's copy or the checkpoint's)."""
    from omegaconf import OmegaConf

    from ..data import identity
    from ..run.resume import expected_identity
    from .instantiate import instantiate
    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    found = expected_identity("auto", run_dir)
    words = found and identity.Expected(
        found.fingerprint, found.checkpoint, key="RUN_DIR",
        consequence="so its tokenizer and prompts would not be the ones its weights learned",
        fix="put the files back as they were (or give --prompt to a run exported for transformers, hf/)")
    with identity.expecting(words):
        return instantiate(OmegaConf.load(config), "data")


def run_config(run_dir: Path) -> dict:
    """The run's saved config (config.yaml), or {} when there is none."""
    from ..run.checkpoint_dir import read_config
    try:
        return read_config(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else {}
    except Exception:  # noqa: BLE001 - a hand-made directory: as if there were none
        return {}


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


def load_qlora(directory: Path, settings: dict, compute: torch.dtype, device: torch.device, transformers):
    """A QLoRA adapter on its base quantised as in training (``settings``: the run's ``peft`` keys)."""
    from ..optim import import_bitsandbytes
    from ..peft import import_peft
    import_bitsandbytes("RUN_DIR", "a QLoRA run's base")
    peft = import_peft()
    base_path = json.loads((directory / "adapter_config.json").read_text())["base_model_name_or_path"]
    options = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=settings.get("quant_type", "nf4"),
                                              bnb_4bit_use_double_quant=settings.get("double_quant", True),
                                              bnb_4bit_compute_dtype=compute)
    where = device.index if device.type == "cuda" and device.index is not None else str(device)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, quantization_config=options, dtype=torch.float32,
                                                             local_files_only=True, device_map={"": where})
    for m in base.modules():  # bitsandbytes' CPU inference kernel cannot take layers narrower than a block
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return peft.PeftModel.from_pretrained(base, str(directory))


def load_hf(directory: Path, device: torch.device, config: dict | None = None):
    """(model, tokenizer, is_classifier) from a transformers or peft directory, local files only;
    ``config``: the run's saved config (a QLoRA adapter then loads on its 4-bit base)."""
    from ..hf import import_transformers
    transformers = import_transformers()
    adapter = directory / "adapter_config.json"
    peft_settings = (config or {}).get("peft") or {}
    if adapter.is_file() and str(peft_settings.get("_target_", "")).endswith(".QLoRA"):
        precision = str(((config or {}).get("precision") or {}).get("_target_", ""))
        compute = {"BF16": torch.bfloat16, "FP16": torch.float16}.get(precision.rpartition(".")[2], torch.float32)
        from ..hf import has_tokenizer
        if not has_tokenizer(directory):
            raise ConfigError("RUN_DIR", f"{directory} holds no tokenizer", "train on text data to sample text")
        try:
            model = load_qlora(directory, peft_settings, compute, device, transformers)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as err:
            raise ConfigError("RUN_DIR", f"{directory} does not load: {' '.join(str(err).split())[:300]}",
                              "give a run directory of a finished run (it holds hf/)") from None
        return model.eval(), tokenizer, False
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
    run_dir = directory.parent if directory.name == "hf" else directory
    model, tokenizer, classifier = load_hf(directory, device, run_config(run_dir))
    prompt, chat = default_prompt(run_dir, prompt, args.raw)
    # a templated prompt holds its special tokens as text: the template's own BOS, nothing added
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not chat).to(device)
    if classifier:
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
    corpus = run_corpus(run_dir)
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


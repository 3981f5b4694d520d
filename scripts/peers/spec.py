"""The side-by-side jobs of scripts/bench_peers.py: each workload's model shape, data, batch and
steps (one job, the same for every framework), and the files every framework reads (written once).

Imports torch and numpy only (transformers when a base model is written): each runner process
imports this, whichever framework it drives.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

IGNORE = -100

# Llama-3.2-1B's and -3B's shapes (their config.json), GPT-2 small's; random weights, no download.
LLAMA_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=True, max_position_embeddings=131072)
LLAMA_3B = dict(LLAMA_1B, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128)
GPT2_SMALL = dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LLAMA_TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, max_position_embeddings=256)
GPT2_TINY = dict(GPT2_SMALL, vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64)

# llm.c's GPT-2 (124M) rate: 140 ms per 524,288-token step on 8 H100s, per GPU.
LLMC_TOKENS_PER_S = 468_000

WORKLOADS = {
    "pretrain": dict(
        title="pretraining: Llama-3.2-1B-shaped (random weights from its config), sequence 2048, bf16",
        model=LLAMA_1B, tiny_model=LLAMA_TINY, data="lm", seq_len=2048, tiny_seq_len=64,
        micro_batch=4, accum=2, steps=14, warmup=6, tiny_steps=5, tiny_warmup=2, lr=3e-4,
        frameworks=["looplib", "torchtitan", "hf_trainer"]),
    "gpt2": dict(
        title="GPT-2 small (124M), sequence 1024, bf16",
        model=GPT2_SMALL, tiny_model=GPT2_TINY, data="lm", seq_len=1024, tiny_seq_len=64,
        micro_batch=8, accum=4, steps=12, warmup=5, tiny_steps=5, tiny_warmup=2, lr=6e-4,
        frameworks=["looplib", "hf_trainer"], record=("llm.c (per H100, its published rate)", LLMC_TOKENS_PER_S)),
    "qlora": dict(
        title="QLoRA: Llama-3.2-3B-shaped base (random weights, written once), NF4, LoRA r=16 on every linear "
              "layer, instruct data (loss on the completion only), sequence 2048, bf16",
        model=LLAMA_3B, tiny_model=LLAMA_TINY, data="instruct", seq_len=2048, tiny_seq_len=64,
        micro_batch=2, accum=2, steps=9, warmup=3, tiny_steps=4, tiny_warmup=1, lr=2e-4,
        lora=dict(r=16, alpha=16, dropout=0.0,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        frameworks=["looplib", "hf_trainer", "unsloth"]),
    "dpo": dict(  # scripts/peers/dpo.py: its model (a tokenizer trained on the pairs), pairs, TRL's runner
        title="DPO: Llama-3.2-1B's body over an 8k BPE vocabulary trained on the pairs, full fine-tuning (the "
              "reference a frozen copy), sigmoid loss beta 0.1, sequence 1024, bf16; the rate in pairs/s",
        model=dict(vocab_size=8192), tiny_model=dict(vocab_size=512), data="pairs", seq_len=1024, tiny_seq_len=64,
        micro_batch=4, accum=2, steps=12, warmup=5, tiny_steps=12, tiny_warmup=4, lr=5e-6,  # tiny: 8 timed steps
        frameworks=["looplib", "trl"]),
}
# tiny jobs take large steps, so that a difference in any setting between two frameworks shows in the losses
TINY_LR = 1e-2
# the settings every framework shares (what makes it one job); each framework's own come on top
COMMON = dict(weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, max_grad_norm=1.0, seed=0)


def job(workload: str, tiny: bool) -> dict:
    """The job every framework of ``workload`` runs: shape, batch, steps, optimizer settings."""
    w = WORKLOADS[workload]
    seq = w["tiny_seq_len"] if tiny else w["seq_len"]
    model = dict(w["tiny_model"] if tiny else w["model"])
    steps, warmup = (w["tiny_steps"], w["tiny_warmup"]) if tiny else (w["steps"], w["warmup"])
    lr = TINY_LR if tiny else w["lr"]
    return {"workload": workload, "tiny": tiny, "model": model, "data": w["data"], "seq_len": seq,
            "micro_batch": w["micro_batch"], "accum": w["accum"], "global_batch": w["micro_batch"] * w["accum"],
            "steps": steps, "warmup": warmup, "lr": lr, "lora": w.get("lora"), **COMMON}


def vocab(spec: dict) -> int:
    return spec["model"]["vocab_size"]


def write_data(spec: dict, folder: Path) -> Path:
    """One job's token rows, written once and read by every framework: ``input_ids.npy`` and
    ``labels.npy`` (int32, rows x seq_len; labels already shifted: ``labels[t]`` is the token after
    ``input_ids[t]``, -100 where no loss is taken). ``lm``: uniform random tokens, a loss on every
    position; ``instruct``: a prompt of a quarter to half the window (no loss) and its completion.
    Rows cover every step once; every framework reads them in looplib's order (``permutation``)."""
    n = spec["global_batch"] * spec["steps"]
    seq, vocab_size = spec["seq_len"], vocab(spec)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, vocab_size, size=(n, seq + 1), dtype=np.int64)
    labels = tokens[:, 1:].copy()
    if spec["data"] == "instruct":
        prompt = rng.integers(seq // 4, seq // 2, size=n)
        for i, p in enumerate(prompt):
            labels[i, :p - 1] = IGNORE  # positions before the prompt's last token predict prompt tokens
    np.save(folder / "input_ids.npy", tokens[:, :-1].astype(np.int32))
    np.save(folder / "labels.npy", labels.astype(np.int32))
    (folder / "data.json").write_text(json.dumps({"rows": n, "seq_len": seq, "vocab_size": vocab_size,
                                                  "kind": spec["data"]}))
    return folder


def load_rows(folder: str | Path) -> tuple[np.ndarray, np.ndarray]:
    folder = Path(folder)
    return np.load(folder / "input_ids.npy", mmap_mode="r"), np.load(folder / "labels.npy", mmap_mode="r")


def write_model(spec: dict, folder: Path, device: str = "cpu") -> Path:
    """The model's initial weights as a Hugging Face directory (config.json + safetensors), from
    its config with seeded random weights: written once, loaded by looplib (model=hf), the Trainer
    and unsloth, so every framework that reads it starts from the same weights (bf16 for a QLoRA
    base, which each quantises the same way; fp32 otherwise)."""
    import torch
    import transformers
    if (folder / "config.json").exists():
        return folder
    config = dict(spec["model"])
    kind = config.pop("model_type")
    cfg = transformers.AutoConfig.for_model(kind, **config)
    dtype = torch.bfloat16 if spec["lora"] else torch.float32
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="4GB")
    tmp.rename(folder)
    return folder


def permutation(n: int, seed: int) -> list[int]:
    """The order looplib's sampler reads n rows in its first epoch (``looplib.data.loading.EpochSampler``:
    ``torch.randperm`` seeded with the run's seed): the other frameworks read the rows in this order too."""
    import torch
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()

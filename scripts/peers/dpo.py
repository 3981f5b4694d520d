"""The ``dpo`` workload of scripts/bench_peers.py: looplib's ``loss=dpo`` beside TRL's
``DPOTrainer``, full fine-tuning with a frozen copy as the reference on both sides, on the same
model directory (one tokenizer, one set of initial weights), the same pairs in the same order,
global batch, precision, optimizer settings and steps.

    python scripts/peers/dpo.py SPEC.json        # TRL's row (written by scripts/bench_peers.py)

The pairs (``pairs.jsonl``: prompt, chosen, rejected as text) are written once; each framework
tokenises them itself (looplib: [BOS] prompt completion EOS, prompt and completion encoded
apart; TRL: prompt + completion encoded together, its EOS added), so a pair's tokens may differ
by a merge at the boundary. The figure is pairs per second of the median step after the warm-up
steps (a pair: the prompt with its chosen and its rejected completion, both forward passes of the
policy and of the reference, and the backward), and the allocator's peak (a CPU: peak RSS).
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BETA = 0.1
# Llama-3.2-1B's body (its config.json) over a byte-level BPE vocabulary trained on the pairs
# (no download: the benchmark writes its own tokenizer); the tiny model for the CPU.
BODY = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY_BODY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5)
TRL_SETTINGS = {"gpu": {"bf16": True, "optim": "adamw_torch_fused"}, "cpu": {"optim": "adamw_torch"}}
LOOPLIB_SETTINGS = {"gpu": ["+precision=bf16", "+optim=adamw", "optim.impl=fused"],
                    "cpu": ["+optim=adamw", "optim.impl=for-loop"]}


def words(n: int, rng: random.Random) -> str:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "fe", "gu", "hi", "ja", "be"]
    return " ".join("".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(n))


def write_data(spec: dict, folder: Path) -> Path:
    """``global_batch x steps`` pairs, seeded: a prompt of a quarter of the sequence, completions of
    a sixth to a third of it (the tiny job: a few words each)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng, seq = random.Random(1234), spec["seq_len"]
    with open(folder / "pairs.jsonl", "w") as f:
        for _ in range(spec["global_batch"] * spec["steps"]):
            f.write(json.dumps({"prompt": words(rng.randint(seq // 8, seq // 4), rng) + "?",
                                "chosen": " " + words(rng.randint(seq // 8, seq // 4), rng),
                                "rejected": " " + words(rng.randint(seq // 8, seq // 4), rng)}) + "\n")
    return folder


def write_model(spec: dict, folder: Path, device: str = "cpu") -> Path:
    """The tokenizer (trained on the pairs) and the seeded initial weights, fp32, written once."""
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers
    from looplib.make_tiny_model import make_tiny_model
    tmp = folder.with_name(folder.name + ".tmp")
    data = Path(spec["data_dir"]) / "pairs.jsonl"
    make_tiny_model(tmp, [str(data)], vocab_size=spec["model"]["vocab_size"], max_positions=spec["seq_len"] + 8)
    config = transformers.AutoConfig.from_pretrained(tmp)
    for k, v in (TINY_BODY if spec["tiny"] else BODY).items():
        setattr(config, k, v)
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def looplib_command(spec: dict, overrides: list[str], run_dir: Path) -> list[str]:
    vocab = json.loads((Path(spec["model_dir"]) / "config.json").read_text())["vocab_size"]
    adamw = [f"optim.betas=[{spec['betas'][0]},{spec['betas'][1]}]", f"optim.eps={spec['eps']}"]
    return [sys.executable, "-m", "looplib.train", "model=hf", f"model.path={spec['model_dir']}",
            f"model.seq_len={spec['seq_len']}", "data=preference", f"data.path={spec['data_dir']}/pairs.jsonl",
            f"data.vocab_size={vocab}", "data.eval_fraction=0", "loss=dpo", f"loss.beta={BETA}", *overrides, *adamw,
            f"batch_size={spec['micro_batch']}", f"accum_steps={spec['accum']}", f"max_steps={spec['steps']}",
            f"lr={spec['lr']}", f"weight_decay={spec['weight_decay']}", f"max_grad_norm={spec['max_grad_norm']}",
            f"seed={spec['seed']}", f"device={spec['device']}", "log_every=1", "eval_every=0", "eval_samples=0",
            "sample_tokens=0", "checkpoint.enabled=false", "progress=lines", f"hydra.run.dir={run_dir}"]


def pairs_per_s(spec: dict, result: dict) -> dict:
    """The row's rate: the global batch's pairs over the median step (``measure.summary``'s)."""
    return {**result, "pairs_per_s": spec["global_batch"] / result["median_step_s"], "tokens_per_s": None}


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import datasets
    import torch
    import transformers
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from measure import StepClock, device_for, emit, reset_peak, summary, versions
    from spec import permutation

    device = device_for(spec)
    torch.manual_seed(spec["seed"])
    rows = [json.loads(line) for line in open(Path(spec["data_dir"]) / "pairs.jsonl")]
    order = permutation(len(rows), spec["seed"])
    tok = transformers.AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], local_files_only=True,
                                                              dtype=torch.float32, attn_implementation="sdpa")
    clock, losses, pending = StepClock(device), [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            reset_peak(device)
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            clock.step_end()
            losses.append(sum(pending))
            pending.clear()

    class InLooplibOrder(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return order

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            pending.append((out[0] if return_outputs else out).detach().float().clone() / spec["accum"])
            return out

    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(
            output_dir=tmp, max_steps=spec["steps"], per_device_train_batch_size=spec["micro_batch"],
            gradient_accumulation_steps=spec["accum"], learning_rate=spec["lr"], weight_decay=spec["weight_decay"],
            adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1], adam_epsilon=spec["eps"],
            max_grad_norm=spec["max_grad_norm"], lr_scheduler_type="constant", warmup_steps=0, beta=BETA,
            loss_type=["sigmoid"], max_length=spec["seq_len"] + 1, save_strategy="no", report_to=[],
            disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0, seed=spec["seed"],
            data_seed=spec["seed"], use_cpu=device.type != "cuda", **spec["trainer"])
        trainer = InLooplibOrder(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                 processing_class=tok, callbacks=[Clock()])
        trainer.train()
    result = summary(spec, clock.step_times(), [float(x) for x in losses], device,
                     versions=versions("trl", "transformers", "accelerate", "torch"))
    emit(pairs_per_s(spec, result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1]))

"""One side-by-side row through the Hugging Face Trainer (``hf_trainer``), or through unsloth's
model loading and patches under the same Trainer (``unsloth``):

    python scripts/peers/hf_trainer.py SPEC.json        # written by scripts/bench_peers.py

The job (model directory, data rows, batch, steps, optimizer) comes from the spec; the Trainer's
own settings from ``spec["trainer"]`` (TrainingArguments keys). The rows are read in looplib's
order (a sampler over ``spec.permutation``), and the labels are the data's own, already shifted:
they reach the loss as ``shift_labels`` (transformers' causal-LM loss then shifts nothing), so
every framework computes the same loss over the same tokens.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def load_model(spec: dict, unsloth: bool):
    import torch
    device = torch.device(spec["device"])
    lora = spec.get("lora")
    compute = torch.bfloat16 if spec["trainer"].get("bf16") else torch.float32
    if unsloth:
        from unsloth import FastLanguageModel
        model, _ = FastLanguageModel.from_pretrained(model_name=spec["model_dir"], max_seq_length=spec["seq_len"],
                                                     dtype=compute, load_in_4bit=True, local_files_only=True)
        model = FastLanguageModel.get_peft_model(
            model, r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], bias="none",
            target_modules=lora["target_modules"], use_gradient_checkpointing="unsloth", random_state=spec["seed"])
        return model
    import transformers
    kw = {"attn_implementation": "sdpa"}
    if lora:
        kw["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute)
        kw["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
        kw["dtype"] = compute
    else:
        kw["dtype"] = torch.float32  # fp32 weights; bf16 comes from autocast (TrainingArguments bf16)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], local_files_only=True, **kw)
    if lora:
        import peft
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=bool(spec["trainer"].get("gradient_checkpointing")),
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], bias="none",
            target_modules=lora["target_modules"], task_type="CAUSAL_LM"))
    return model


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    unsloth = spec["framework"] == "unsloth"
    if unsloth:
        import unsloth  # noqa: F401 - first, as its docs ask: it patches transformers and peft on import
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from measure import StepClock, device_for, emit, reset_peak, summary, versions
    from spec import permutation
    from token_rows import TokenRows

    device = device_for(spec)
    notes = []
    if spec["trainer"].get("use_liger_kernel") and (device.type != "cuda" or find_spec("liger_kernel") is None):
        spec["trainer"].pop("use_liger_kernel")  # the Trainer would refuse to start
        notes.append("use_liger_kernel off: liger-kernel " + ("needs CUDA" if device.type != "cuda" else "not installed"))
    torch.manual_seed(spec["seed"])
    data = TokenRows(spec["data_dir"])
    order = permutation(len(data), spec["seed"])
    model = load_model(spec, unsloth)
    clock, losses, pending = StepClock(device), [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            reset_peak(device)
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            clock.step_end()
            losses.append(sum(pending))  # the window's mean loss: each micro-batch's sum / the window's items
            pending.clear()

    class InLooplibOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return order

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            pending.append((out[0] if return_outputs else out).detach().float().clone())
            return out

    def collate(rows):
        ids = torch.stack([r["input_ids"] for r in rows])
        labels = torch.stack([r["labels"] for r in rows])
        return {"input_ids": ids, "labels": labels, "shift_labels": labels}

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=spec["steps"], per_device_train_batch_size=spec["micro_batch"],
            gradient_accumulation_steps=spec["accum"], learning_rate=spec["lr"], weight_decay=spec["weight_decay"],
            adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1], adam_epsilon=spec["eps"],
            max_grad_norm=spec["max_grad_norm"], lr_scheduler_type="constant", warmup_steps=0,
            save_strategy="no", report_to="none", disable_tqdm=True, logging_strategy="no",
            dataloader_num_workers=0, seed=spec["seed"], data_seed=spec["seed"], remove_unused_columns=False,
            use_cpu=device.type != "cuda", **spec["trainer"])
        trainer = InLooplibOrder(model=model, args=args, train_dataset=data, data_collator=collate,
                                 callbacks=[Clock()])
        trainer.train()
    times = clock.step_times()
    result = summary(spec, times, [float(x) for x in losses], device,
                     versions=versions("transformers", "accelerate", "peft", "bitsandbytes", "liger-kernel",
                                       "unsloth", "unsloth_zoo", "torch"))
    result["optim"] = str(getattr(trainer.args.optim, "value", trainer.args.optim))
    result["notes"] = notes
    emit(result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1]))

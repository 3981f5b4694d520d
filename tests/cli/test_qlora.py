"""+peft=qlora: LoRA on a frozen base held in 4 bits (bitsandbytes NF4), on the bundled GPT and on a
transformers Llama read from model.path (quantised while it loads): the loss falls, the base stays
packed and frozen, the adapter loads with peft on the 4-bit base (the trained logits exactly) and
on the full-precision base, merge dequantises, the planner's bytes are the real ones, and what
cannot work is one line."""
import json

import pytest
import torch

from looplib import AdamW, train_model
from looplib.cli.instantiate import instantiate
from looplib.loss import TokenCrossEntropy
from looplib.cli.plan import build_plan
from looplib.quantize import is_4bit, quant_tensors, quantize
from looplib.store.export import write_exports

from conftest import needs_bnb, random_tokens, run_cli, tiny_gpt

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'looplib[peft]')")
pytestmark = needs_bnb


def qlora(**settings):
    from looplib.peft import QLoRA
    return QLoRA(**{"r": 4, "alpha": 8, "allow_random_base": True, **settings})


def losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if '"loss"' in line]


def real_bytes(model) -> dict:
    """Parameters (4-bit ones: packed bytes and quantisation constants), gradients, each storage once."""
    seen, weights = set(), 0
    for p in {id(p): p for p in model.parameters()}.values():
        for t in [p, *(quant_tensors(p) if getattr(p, "quant_state", None) is not None else [])]:
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                weights += t.untyped_storage().nbytes()
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    return {"weights": weights, "gradients": grads}


def state_bytes(opt) -> int:
    return sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def compose_with(*overrides):
    from hydra import compose, initialize_config_module
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_qlora_on_the_bundled_gpt(tmp_path):
    result = train_model(tiny_gpt(), random_tokens(n=8), peft=qlora(), optim=AdamW(lr=2e-2), max_steps=12,
                         batch_size=4, device="cpu", log_every=1, metrics=tmp_path / "metrics.jsonl")
    trace = losses(tmp_path / "metrics.jsonl")
    assert trace[-1] < trace[0] - 0.1
    model = result.model
    from looplib.run.training import parameter_counts
    total, trained, four_bit = parameter_counts(model)  # the header's count: 4-bit weights at their shape, not bytes
    assert total == sum(p.numel() for p in tiny_gpt().parameters()) + trained and 0 < trained < total / 5
    assert four_bit == sum(m.weight.numel() for n, m in tiny_gpt().named_modules()  # the 8 adapted Linear layers
                           if isinstance(m, torch.nn.Linear) and not n.endswith("head"))
    fresh = quantize(tiny_gpt(), qlora().bnb, "nf4", True, torch.float32, torch.device("cpu"))
    fourbit = {n.replace("base_model.model.", "").replace(".base_layer", ""): m for n, m in model.named_modules()
               if is_4bit(m)}
    assert len(fourbit) == 8 and all(  # 2 blocks x qkv, proj, mlp.0, mlp.2; the tied head stays whole
        m.weight.dtype == torch.uint8 and not m.weight.requires_grad for m in fourbit.values())
    for name, m in fresh.named_modules():  # the base did not move: as quantised from the same weights
        if name in fourbit:
            assert torch.equal(fourbit[name].weight, m.weight)
    held = {id(p) for g in result.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if "lora_" in n}

    write_exports(model, tmp_path, qlora().exports())  # the adapter, in peft's format
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    model.eval()
    with torch.no_grad():
        trained = model(ids)
        on_4bit = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
        torch.testing.assert_close(on_4bit(ids), trained, rtol=0, atol=0)
        on_full = peft.PeftModel.from_pretrained(tiny_gpt(), str(tmp_path / "adapter")).eval()
        assert 0 < (on_full(ids) - trained).abs().max() < 0.5  # the base's quantisation error apart
    assert on_full.generate(ids[:1, :4], 4).shape == (1, 8)

    # a checkpoint's model.safetensors restores the packed bytes and their constants (resume)
    from safetensors.torch import load_model, save_model
    save_model(model, str(tmp_path / "checkpoint.safetensors"))
    other = qlora().wrap(tiny_gpt(seed=9)).eval()  # another base, quantised
    load_model(other, str(tmp_path / "checkpoint.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(other(ids), trained, rtol=0, atol=0)

    write_exports(model, tmp_path / "merged", qlora(merge=True).exports())  # dequantised and merged: the plain model's keys
    merged = tiny_gpt(seed=5)
    load_model(merged, tmp_path / "merged" / "model.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(ids), trained, rtol=1e-4, atol=1e-4)

    plan = build_plan(compose_with("+peft=qlora", "peft.r=4", "peft.alpha=8", "data=random", "data.vocab_size=64",
                                   "model.seq_len=16", "model.n_layer=2", "model.n_head=2", "model.d_model=32"),
                      memory=2**30)
    TokenCrossEntropy()(model, {"input_ids": ids, "labels": ids}).backward()  # the loop has freed its gradients
    real = real_bytes(model)
    assert (plan.weights, plan.gradients, plan.optim_state) == (real["weights"], real["gradients"],
                                                               state_bytes(result.optimizer))
    # DeepSpeed, which refuses the 4-bit base, gets no table; FSDP2's per-rank rows for it are shown
    # (tests/dist/test_qlora_fsdp.py checks them against two ranks' bytes, and what the planner advises)
    from looplib.plan.render import render
    text = render(plan)
    assert plan.four_bit and "ZeRO model state per rank" not in text and "DeepSpeed ZeRO: refused with +peft=qlora" in text
    assert "FSDP2 (+engine=fsdp) per rank, 1 rank(s), the 4-bit base sharded" in text


def chat_records(path, n=24):
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 7, i % 5
            f.write(json.dumps({"messages": [{"role": "user", "content": f"add {a} and {b}"},
                                             {"role": "assistant", "content": str(a + b)}]}) + "\n")
    return path


def test_qlora_on_a_llama_read_from_model_path(tiny_pretrained, tmp_path, capsys):
    """Trained on chat records through the command line: the end-of-run sample and looplib.generate
    prompt it through its chat template, and generate loads the adapter on the 4-bit base."""
    transformers = pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    job = ["model=hf", f"model.path={tiny_pretrained}", "model.seq_len=32", "+peft=qlora", "data=instruct",
           f"data.path={chat_records(tmp_path / 'chat.jsonl')}"]
    r = run_cli(*job, "max_steps=8", "batch_size=4", "lr=3e-2", "log_every=1", "eval_samples=0", "sample_tokens=6",
                f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    trace = losses(run_dir / "metrics.jsonl")
    assert trace[-1] < trace[0] - 0.1
    sample = (run_dir / "sample.txt").read_text()
    assert sample.startswith("<|user|>\nadd ") and "<|assistant|>\n" in sample  # a held-out conversation, templated
    from looplib.cli.generate import default_prompt, main
    from looplib.store.finished import load_hf, run_config
    assert main([str(run_dir), "--prompt", "add 2 and 3", "--tokens", "3"]) == 0  # python -m looplib.generate
    printed = capsys.readouterr().out
    assert printed.startswith("<|user|>\nadd 2 and 3\n<|assistant|>\n"), printed
    assert default_prompt(run_dir, "add 2 and 3", raw=True) == ("add 2 and 3", False)
    config = json.loads((run_dir / "hf" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_pretrained)
    assert {t.rsplit(".", 1)[-1] for t in config["target_modules"]} == {  # every linear layer but lm_head
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

    # peft loads the adapter on the 4-bit base (as looplib.generate does: BitsAndBytesConfig) and on the
    # full-precision model.path, and both generate
    on_4bit = load_hf(run_dir / "hf", torch.device("cpu"), run_config(run_dir))[0]
    assert isinstance(on_4bit, peft.PeftModel) and sum(is_4bit(m) for m in on_4bit.modules()) == 14
    full = peft.AutoPeftModelForCausalLM.from_pretrained(str(run_dir / "hf")).eval()
    ids = torch.randint(0, 384, (1, 8), generator=torch.Generator().manual_seed(3))
    for model in (full, on_4bit):
        assert model.generate(input_ids=ids, max_new_tokens=4, do_sample=False).shape == (1, 12)
    with torch.no_grad():
        assert (full(input_ids=ids).logits - on_4bit(input_ids=ids).logits).abs().max() < 0.5

    # quantised while it loads (transformers' BitsAndBytesConfig), and planned to the byte
    cfg = compose_with(*job[:-2], "data=random", "data.vocab_size=384")
    strategy = instantiate(cfg, "peft")
    with strategy.loading():
        model = instantiate(cfg, "model")
    assert model.hf.is_loaded_in_4bit and sum(is_4bit(m) for m in model.modules()) == 14
    model = strategy.wrap(model)
    opt = AdamW(lr=1e-3).build(model)
    TokenCrossEntropy()(model, {"input_ids": ids, "labels": ids}).backward()
    opt.step()
    plan = build_plan(cfg, memory=2**30)
    real = real_bytes(model)
    assert (plan.weights, plan.gradients, plan.optim_state) == (real["weights"], real["gradients"], state_bytes(opt))
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)

    # merge=true: the dequantised base with the adapter merged, a full-precision directory
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
        expected = model.eval()(ids)
    write_exports(model, tmp_path / "merged", qlora(merge=True).exports())
    saved = json.loads((tmp_path / "merged" / "hf" / "config.json").read_text())
    assert "quantization_config" not in saved
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_deepspeed_is_refused_through_the_cli(tmp_path):
    r = run_cli("+peft=qlora", "+engine=deepspeed", "data=random", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("looplib: error: peft: +engine=deepspeed with +peft=qlora: ZeRO flattens"), r.stderr
    assert not (tmp_path / "run").exists()

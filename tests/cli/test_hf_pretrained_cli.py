"""A pretrained directory through the command line: fine-tuning, a misspelt key, generate, the planner, a ZeRO-3 LoRA export (the in-process tests: tests/unit/test_hf_pretrained.py)."""
import json
import pytest
import torch
from safetensors.torch import load_model, save_model
from looplib import RandomTokens

from conftest import run_cli, tiny_gpt
from test_hf_pretrained import SEQ, VOCAB, ids_batch, logits_of, peft, transformers  # noqa: F401 - helpers the tests share


def test_fine_tune_through_the_cli_starts_from_the_weights_and_exports_what_it_trained(tiny_pretrained, tmp_path):
    from looplib.hf import CausalLM
    run_dir = tmp_path / "run"
    # no model.seq_len: the window defaults to the model's 64 positions (conf/model/hf.yaml)
    r = run_cli("model=hf", f"model.path={tiny_pretrained}", "data=random",
                f"data.vocab_size={VOCAB}", "data.n_train=4", "data.n_eval=4", "max_steps=3", "batch_size=4",
                "lr=1e-2", "log_every=1", "eval_samples=4", "sample_tokens=4", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for noise in ("torchao", "_pytree", "triton", "bitsandbytes"):  # third-party import notes: not the user's to act on
        assert noise not in r.stderr, r.stderr
    assert "training CausalLM (LlamaForCausalLM) (" in r.stdout  # the header names the model inside the wrapper
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    positions = json.loads((tiny_pretrained / "config.json").read_text())["max_position_embeddings"]
    assert f"seq_len: {positions}" in (run_dir / "config.yaml").read_text()
    # the first step's loss is transformers' loss of the pretrained model on the same 4 sequences
    data = RandomTokens(4, positions, VOCAB, seed=0)
    full = torch.cat([data.input_ids[:, :1], torch.stack([d["labels"] for d in data])], dim=1)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(tiny_pretrained)
    with torch.no_grad():
        expected = pretrained(input_ids=full, labels=full).loss.item()
    assert rows[0]["step"] == 1 and rows[0]["loss"] == pytest.approx(expected, rel=1e-5)
    # hf/ is the trained model: transformers reloads it with looplib's final logits
    final = CausalLM(path=str(tiny_pretrained))  # the Python API's default window: the same rule
    assert final.seq_len == positions
    load_model(final, str(sorted((run_dir / "checkpoints").iterdir())[-1] / "model.safetensors"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    ids = ids_batch()
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(final, ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits_of(pretrained, ids), logits_of(final, ids), atol=1e-3)  # it trained
    assert transformers.AutoTokenizer.from_pretrained(run_dir / "hf").encode("def f")  # self-contained
    # and looplib.generate samples from it
    g = run_cli(str(run_dir), "--prompt", "def ", "--tokens", "5", module="looplib.generate", cwd=tmp_path)
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("def ")


def test_a_misspelt_model_key_through_the_cli_exits_2_with_one_line(tiny_pretrained, tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("model=llama_tiny", f"+model.pretrained_model_name_or_path={tiny_pretrained}", "data=random",
                f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == [lines[-1]] and "model.pretrained_model_name_or_path" in lines[-1] and "model.path" in lines[-1]
    assert not run_dir.exists()


def test_generate_samples_a_bundled_model_run(tmp_path, capsys):
    from looplib.cli.generate import main
    (tmp_path / "config.yaml").write_text(
        "model: {_target_: looplib.models.GPT, vocab_size: 64, seq_len: 16, n_layer: 2, n_head: 2, d_model: 32}\n"
        "data: {_target_: looplib.data.RandomCorpus, seq_len: 16, vocab_size: 64}\n")
    save_model(tiny_gpt(), str(tmp_path / "model.safetensors"))
    assert main([str(tmp_path), "--prompt", "abc", "--tokens", "3", "--device", "cpu"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:3] == [str(ord(c) % 64) for c in "abc"] and len(words) == 6
    assert main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_the_planner_plans_a_pretrained_directory_without_loading_it(tiny_pretrained, capsys):
    from looplib.cli.plan import main
    assert main([f"model=hf", f"model.path={tiny_pretrained}", f"model.seq_len={SEQ}", "data=random",
                 "+checkpointing=blocks", "--memory-gib", "1"]) == 0
    out = capsys.readouterr().out
    n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(tiny_pretrained).parameters())
    assert f"CausalLM ({n:,} trainable parameters)" in out and "with checkpointing (2 modules)" in out


def test_zero3_lora_export_gathers_the_shards(tiny_pretrained, tmp_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'looplib[deepspeed]')")
    run_dir = tmp_path / "run"
    r = run_cli("model=hf", f"model.path={tiny_pretrained}", f"model.seq_len={SEQ}", "data=random",
                f"data.vocab_size={VOCAB}", "+peft=lora", "+engine=deepspeed", "engine.stage=3", "max_steps=2",
                "batch_size=4", "lr=1e-2", "log_every=1", "eval_samples=4", "sample_tokens=0",
                f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file
    adapter = load_file(run_dir / "hf" / "adapter_model.safetensors")
    assert adapter and all(t.numel() > 0 for t in adapter.values())          # whole, not rank-0 partitions
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)  # trained (B starts at zero)
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(run_dir / "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_pretrained)
    ids = ids_batch()
    assert not torch.allclose(logits_of(loaded, ids), logits_of(base, ids), atol=1e-4)

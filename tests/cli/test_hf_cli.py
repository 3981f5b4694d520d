"""A transformers Llama through the command line (the in-process tests: tests/unit/test_hf.py)."""
import json

from conftest import needs_bnb, run_cli


@needs_bnb
def test_llama_through_the_cli(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("model=llama_tiny", "model.seq_len=16", "model.hidden_size=32", "model.intermediate_size=64",
                "model.num_hidden_layers=1", "model.gradient_checkpointing=true", "+precision=bf16", "+optim=adam8bit",
                "data=random", "max_steps=2", "batch_size=2", "log_every=1", "eval_samples=4", "sample_tokens=4",
                f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows if "loss" in m] == [1, 2]
    assert "looplib.hf.CausalLM" in (run_dir / "config.yaml").read_text()
    assert "a sample from the trained model" in r.stdout

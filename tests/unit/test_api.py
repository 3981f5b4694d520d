"""The loop without Hydra: train_model builds what the CLI builds, and a script that uses it
never imports Hydra or OmegaConf."""
import json

import torch

from looplib import (BF16, SGD, Accumulation, AdamW, Engine, Epochs, HalfWeights, TokenCrossEntropy,
                     WarmupCosine, build_loader, fit, train_model)

from conftest import REPO, random_tokens, tiny_gpt


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_train_model_equals_fit_with_hand_built_pieces():
    data = random_tokens(n=24)
    result = train_model(tiny_gpt(), data, max_steps=5, batch_size=4, accum_steps=2, precision=BF16(),
                         optim=AdamW(lr=3e-3, weight_decay=0.1), schedule=WarmupCosine(warmup_steps=2),
                         max_grad_norm=1.0, device="cpu", seed=3)
    assert result.state.step == 5
    # the same run, every piece built by hand
    model, precision, engine = tiny_gpt(), BF16(), Engine("cpu")
    precision.setup(engine.device)
    optimizer = AdamW(lr=3e-3, weight_decay=0.1).build(model)
    fit(model, Epochs(build_loader(data, batch_size=4, seed=3)), objective=TokenCrossEntropy(),
        optimizer=optimizer, scheduler=WarmupCosine(warmup_steps=2).build(optimizer, 5), precision=precision,
        accumulation=Accumulation(2), engine=engine, max_steps=5, max_grad_norm=1.0)
    assert torch.equal(flat(result.model), flat(model))
    assert not torch.equal(flat(model), flat(tiny_gpt()))


def test_train_model_evaluates_and_writes_metrics(tmp_path):
    data = random_tokens(n=16)
    result = train_model(tiny_gpt(), data, max_steps=4, batch_size=4, optim=SGD(lr=0.5), eval_dataset=data,
                         eval_every=2, eval_samples=8, evaluation=HalfWeights("bfloat16"), metrics=tmp_path / "m.jsonl",
                         log_every=1, device="cpu")
    rows = (tmp_path / "m.jsonl").read_text().splitlines()
    assert sum('"eval_loss"' in r for r in rows) == 2 and sum('"loss"' in r for r in rows) == 4
    assert result.eval_loss is not None and all(p.dtype == torch.float32 for p in result.model.parameters())


def test_metrics_never_appends_to_another_runs_file(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 99, "loss": 1.0}\n')
    train_model(tiny_gpt(), random_tokens(n=8), max_steps=2, batch_size=4, metrics=path, log_every=1, device="cpu")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "held an earlier run's rows: starting it afresh" in caplog.text


def test_the_readme_example_runs(tmp_path, monkeypatch):
    """docs/python-api.md's first example, as written (fewer steps, on the CPU)."""
    text = (REPO / "docs" / "python-api.md").read_text()
    code = text.split("```python", 1)[1].split("```", 1)[0]
    assert "train_model(" in code
    code = code.replace("max_steps=1000", "max_steps=2").replace('device="auto"', 'device="cpu"')
    code = code.replace("warmup_steps=100", "warmup_steps=1")  # a warm-up as long as the run is refused
    monkeypatch.chdir(tmp_path)
    namespace = {"MyModel": tiny_gpt, "my_dataset": random_tokens(n=16), "my_held_out": random_tokens(n=8, seed=1)}
    exec(compile(code, "docs/python-api.md", "exec"), namespace)
    assert namespace["result"].state.step == 2 and (tmp_path / "metrics.jsonl").exists()


class HFConvention(torch.utils.data.Dataset):
    """Samples as the HF Trainer and TRL make them: labels = input_ids, the prompt masked to -100, unshifted."""

    def __init__(self, n=32, seq_len=16, vocab=64, prompt=5, shift=False):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)
        self.prompt, self.shift = prompt, shift

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        from looplib.data import shift_labels
        labels = self.ids[i].clone()
        labels[:self.prompt] = -100
        sample = {"input_ids": self.ids[i], "labels": labels}
        return shift_labels(sample) if self.shift else sample


def test_hf_convention_labels_are_refused_before_anything_is_written(tmp_path):
    import pytest
    from looplib import ConfigError
    with pytest.raises(ConfigError, match="Hugging Face convention") as err:
        train_model(tiny_gpt(), HFConvention(), max_steps=3, batch_size=4, device="cpu", run_dir=tmp_path / "run")
    assert "\n" not in str(err.value) and "shift_labels" in str(err.value) and err.value.status == 2
    assert not (tmp_path / "run").exists()  # refused before a byte was written
    # shifted with looplib.data.shift_labels, the same samples train (labels[t] = input_ids[t+1] where counted)
    data = HFConvention(shift=True)
    assert torch.equal(data[0]["labels"][4:-1], data[0]["input_ids"][5:]) and data[0]["labels"][-1] == -100
    assert train_model(tiny_gpt(), data, max_steps=2, batch_size=4, device="cpu").state.step == 2

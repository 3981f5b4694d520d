"""train_model meets the launcher rules the command line meets (the tests under torchrun: tests/dist/test_launch_default.py)."""
import pytest


def test_train_model_meets_the_same_launcher_rules(monkeypatch, tmp_path, caplog):
    """looplib.run.launcher for train_model: engine=Local() as one of several processes is refused
    before anything is built or written; no engine is DDP (said in the log line)."""
    from conftest import random_tokens, tiny_gpt
    from looplib import ConfigError, Local, train_model
    from looplib.engines import DDP
    from looplib.run import launcher
    from looplib.run.launcher import engine_for
    monkeypatch.setattr(launcher, "SAID", [])
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        train_model(tiny_gpt(), random_tokens(), max_steps=2, engine=Local("cpu"), run_dir=tmp_path / "run")
    assert str(err.value).startswith("engine: Local runs in one process, but torchrun started 2 of them")
    assert not (tmp_path / "run").exists()
    with caplog.at_level("INFO", logger="looplib"):
        assert isinstance(engine_for(None, "cpu"), DDP)
    assert "torchrun started 2 processes and no engine was chosen: training with +engine=ddp" in caplog.text
    chosen = DDP("cpu")
    assert engine_for(chosen, "cpu") is chosen

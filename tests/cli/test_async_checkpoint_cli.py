"""Asynchronous checkpoints through the command line: a failed write, the setting, a crash mid-write (the in-process tests: tests/unit/test_async_checkpoint.py)."""
import errno
import threading
import pytest
import torch
from looplib import TokenCrossEntropy
from looplib.errors import EXIT_IO, ConfigError
from looplib.store.checkpoint_dir import find_checkpoint, is_valid
from looplib.run.settings import as_config, settings_from

from conftest import run_cli
from test_faults import ENV, TINY, looplib_lines
from test_async_checkpoint import gate  # noqa: F401 - helpers and fixtures the tests share


def test_a_failed_background_write_through_the_command_line_is_one_line_and_status_74(tmp_path, monkeypatch, capsys):
    from looplib import cli
    from looplib.cli.main import main
    monkeypatch.chdir(tmp_path)
    save, calls = torch.save, []

    def full(*args, **kwargs):  # the disk fills up during the second background write
        if threading.current_thread() is not threading.main_thread():
            calls.append(1)
            if len(calls) >= 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return save(*args, **kwargs)
    monkeypatch.setattr(torch, "save", full)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        cli.run(main, [*TINY, "max_steps=40", "checkpoint.async=true", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("looplib:")]
    assert stop.value.code == EXIT_IO and len(said) == 1 and "Traceback" not in err, err
    assert said[0].startswith(f"looplib: error: could not write the checkpoint {run_dir / 'checkpoints' / 'step-00000002'}")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000001"]  # nothing half-written
    assert find_checkpoint(run_dir) == run_dir / "checkpoints" / "step-00000001"
    assert not (run_dir / "model.safetensors").exists()  # the run did not go on to its end


def test_checkpoint_async_is_a_checked_setting_and_deepspeed_refuses_it_in_one_line(tmp_path):
    settings = settings_from({"checkpoint": {"async": True}})
    assert settings.checkpoint.asynchronous is True and as_config(settings)["checkpoint"]["async"] is True
    with pytest.raises(ConfigError, match="^checkpoint.async: checkpoint.async='sometimes' is not true or false"):
        settings_from({"checkpoint": {"async": "sometimes"}})
    with pytest.raises(ConfigError, match="did you mean checkpoint.async"):
        settings_from({"checkpoint": {"asynch": True}})
    r = run_cli("+engine=deepspeed", *TINY, "checkpoint.async=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                env=ENV)
    assert r.returncode == 2 and looplib_lines(r.stderr) == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith("looplib: error: checkpoint.async: +engine=deepspeed writes its ZeRO partitions itself")
    assert not (tmp_path / "run").exists()


def test_a_run_that_crashes_lets_its_directory_go_only_once_the_write_in_flight_is_complete(tmp_path, gate):
    """A step that raises while step 2's checkpoint is being written in the background: ``train_model``
    raises only after that write is complete (its manifest written), so nothing of the run is still
    being written once the directory is released to the next run."""
    from conftest import random_tokens, tiny_gpt
    from looplib import train_model

    class Crash(TokenCrossEntropy):
        calls = 0

        def __call__(self, model, batch):
            Crash.calls += 1
            if Crash.calls == 3:  # step 3: the write of step 2 is still held at its first file
                assert gate.reached.wait(60)
                threading.Timer(0.5, gate.open.set).start()
                raise RuntimeError("a step that crashes")
            return super().__call__(model, batch)

    gate.held.add("00000002")
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="a step that crashes"):
        train_model(tiny_gpt(), random_tokens(), objective=Crash(), max_steps=4, batch_size=4, run_dir=run_dir,
                    checkpoint_every=2, checkpoint_async=True, sample_tokens=0)
    assert ("end", "00000002") in gate.log  # the write ended before train_model returned
    assert is_valid(run_dir / "checkpoints" / "step-00000002") is None  # complete: manifest and all

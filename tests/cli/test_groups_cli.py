"""A group of one's own from the command line (the in-process tests: tests/unit/test_groups.py)."""
import pytest
from looplib.store.checkpoint_dir import read_config

from test_groups import notes_group  # noqa: F401 - helpers and fixtures the tests share


TINY = ["data=random", "data.n_train=16", "data.n_eval=4", "model.n_layer=1", "model.d_model=16", "model.n_head=2",
        "model.seq_len=8", "data.seq_len=8", "batch_size=2", "max_steps=1", "eval_every=0", "eval_samples=0",
        "sample_tokens=0", "checkpoint.enabled=false", "progress=lines", "device=cpu"]


def test_a_group_of_ones_own_works_from_the_command_line(notes_group, monkeypatch, capsys):
    from looplib import cli
    from looplib.cli.main import main
    tmp, _ = notes_group
    monkeypatch.chdir(tmp)
    monkeypatch.setenv("LOOPLIB_PLOT", "0")
    for name, choice in (("chosen", ["notes=loud"]), ("absent", [])):  # typed without "+": a strategy group
        cli.run(main, [*choice, *TINY, f"hydra.searchpath=[file://{tmp / 'conf'}]", f"hydra.run.dir={tmp / name}"])
        saved = read_config(tmp / name / "config.yaml")
        if choice:
            assert saved["notes"] == {"_target_": "notes_group.Note", "text": "hello", "loud": True}
        else:
            assert "notes" not in saved  # absent, no default file: the null object, as in train_model
    bad = [f"+notes.volume=3", "+notes._target_=notes_group.Note", *TINY, f"hydra.run.dir={tmp / 'bad'}"]
    with pytest.raises(SystemExit) as stop:
        cli.run(main, bad)
    assert stop.value.code == 2 and "notes.volume: " in capsys.readouterr().err  # its keys checked like any group's

"""The config groups are listed once (looplib.groups): the command line, train_model, the saved config,
tune and docs/extending.md derive from the table, and a group added to it works everywhere at once."""
import inspect
import textwrap

import pytest

from conftest import REPO, random_tokens, tiny_gpt
from looplib import groups, train_model
from looplib.store.checkpoint_dir import read_config


def test_docs_extending_holds_the_table_of_groups():
    text = (REPO / "docs" / "extending.md").read_text()
    assert "\n".join(groups.markdown_table()) in text, "regenerate the table: python -c 'from looplib import " \
        "groups; print(chr(10).join(groups.markdown_table()))'"


def test_train_model_has_one_keyword_argument_per_group():
    """train_model keeps explicit arguments (for IDEs and help()): exactly the table's, each defaulting to its
    group's null object (None) but the model and the data, which are required."""
    params = inspect.signature(train_model).parameters
    for row in groups.GROUPS:
        assert row.argument in params, f"train_model lacks {row.argument}= for the group {row.name}"
        required = params[row.argument].default is inspect.Parameter.empty
        assert required == (row.null is None), row.name
    bases = {row.base.__name__ for row in groups.GROUPS if row.base is not object}
    typed = {name for name, p in params.items() if any(b in str(p.annotation) for b in bases)}
    assert typed <= {row.argument for row in groups.GROUPS}, "a strategy argument that no row names"


def test_tune_searches_the_groups_the_table_marks():
    from looplib.tune.settings import DIMENSIONS, NUMERICS
    assert set(DIMENSIONS) - {"batch", "optim_impl"} == set(groups.tuned())
    assert set(NUMERICS) == set(groups.tuned("numerics"))


@pytest.fixture
def notes_group(tmp_path, monkeypatch):
    """A throwaway strategy group: a module, a conf folder, a row. Nothing else is touched."""
    (tmp_path / "notes_group.py").write_text(textwrap.dedent('''
        class Note:
            """A group of one's own: what it holds is recorded with the run."""
            def __init__(self, text: str = "plain", loud: bool = False):
                self.text, self.loud = text, loud
    '''))
    conf = tmp_path / "conf" / "notes"
    conf.mkdir(parents=True)
    (conf / "loud.yaml").write_text("# python -m looplib.train +notes=loud\n_target_: notes_group.Note\n"
                                    "text: hello\nloud: true\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import notes_group
    row = groups.Group("notes", notes_group.Note, groups.made(notes_group.Note), None, True, "notes", "notes",
                       calls="nothing: recorded with the run")
    monkeypatch.setattr(groups, "GROUPS", [*groups.GROUPS, row])
    return tmp_path, notes_group.Note


def test_a_group_of_ones_own_works_from_train_model_and_the_docs_table(notes_group):
    tmp, note = notes_group
    train_model(tiny_gpt(seq_len=8), random_tokens(8, seq_len=8), max_steps=1, batch_size=2, notes=note("quiet"),
                run_dir=tmp / "api", device="cpu", progress="lines")
    assert read_config(tmp / "api" / "config.yaml")["notes"] == {"_target_": "notes_group.Note", "text": "quiet",
                                                                 "loud": False}
    train_model(tiny_gpt(seq_len=8), random_tokens(8, seq_len=8), max_steps=1, batch_size=2, run_dir=tmp / "null",
                device="cpu", progress="lines")
    assert read_config(tmp / "null" / "config.yaml")["notes"]["text"] == "plain"  # left out: its null object
    with pytest.raises(Exception, match="notes=.*is not a Note"):
        train_model(tiny_gpt(seq_len=8), random_tokens(8, seq_len=8), max_steps=1, notes=3)
    row = groups.markdown_table(listed=lambda name: ["loud"] if name == "notes" else [])[-1]
    assert row.startswith("| `+notes=` | `loud` | `notes_group.Note` | Note() | `notes=` | - | nothing")

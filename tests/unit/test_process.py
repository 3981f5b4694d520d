"""The process wing's state lives in one object per process: the board's keys move on with each job
this process ends, a fresh ``Process`` starts from the first job again, and the engines name their
collectives and checkpoint formats rather than carry them."""
import pytest
import torch

from looplib import process
from looplib.engines import DDP, Engine
from looplib.engines.fsdp import FSDP
from looplib.process.collectives import GroupRanks, Ranks
from looplib.store import formats


@pytest.fixture
def fresh():
    before = process.this()
    yield process.reset()
    process._THIS = before  # the process's own, as it was


def test_the_boards_keys_are_per_job_and_a_reset_starts_from_the_first(fresh, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    board = process.this().board
    assert board.key("refused") == "looplib/r1/0/job0/refused"
    board.job_done()
    assert board.key("refused") == "looplib/r1/0/job1/refused"
    assert board.key("checked_in", per_job=False) == "looplib/r1/0/checked_in"
    assert process.reset().board.key("refused") == "looplib/r1/0/job0/refused"


def test_one_process_has_no_board_and_says_every_refusal_itself(fresh, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    board = process.this().board
    assert board.store() is None and board.refusal() is None
    assert board.post_refusal("refused: x") and board.says("refused: x")  # no peer to say it once for


def test_engines_name_their_collectives_and_their_checkpoint_format():
    local = Engine("cpu")
    assert type(local.ranks) is Ranks and local.ranks is local.ranks  # made once
    value = torch.tensor([1.0, 2.0])
    assert local.ranks.sum(value) is value and local.ranks.mean(value) is value
    assert local.ranks.any_of(False, True) == [False, True] and local.ranks.from_main("x") == "x"
    assert local.global_items(7) == 7
    assert isinstance(DDP("cpu").ranks, GroupRanks)
    io = formats.of(local)
    assert type(io) is formats.Whole and not io.own_files and formats.of(local) is io
    assert type(formats.of(FSDP("cpu"))) is formats.Sharded and formats.of(FSDP("cpu")).own_files


def test_an_engine_naming_a_format_looplib_does_not_write_is_told_so():
    class Mine(Engine):
        checkpoint_format = "mine"
    with pytest.raises(TypeError, match="checkpoint_format is 'mine'"):
        formats.of(Mine("cpu"))

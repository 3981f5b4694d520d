"""Validation in-process: through train_model and the strategies themselves (the command-line tests: tests/cli/test_validation.py)."""
import pytest
import torch
from looplib import optim as lo
from looplib.run.rules import check_sequences_fit
from looplib.run.assembly import Record
from looplib.run.assembly import refused as refused_while_building
from looplib.data import Epochs, build_loader
from looplib.errors import ConfigError

from conftest import random_tokens, tiny_gpt


def test_a_sample_longer_than_the_model_is_refused():
    from looplib.data import RandomCorpus
    with pytest.raises(ConfigError) as err:
        check_sequences_fit(RandomCorpus(seq_len=32, vocab_size=64, n_train=2), tiny_gpt(seq_len=16))
    assert err.value.key == "data.seq_len"
    check_sequences_fit(RandomCorpus(seq_len=16, vocab_size=64, n_train=2), tiny_gpt(seq_len=16))


def test_a_librarys_own_error_names_the_group():
    class Unchecked(lo.OptimizerFactory):  # no annotations: torch itself refuses the betas
        def create(self, groups):
            return torch.optim.AdamW(groups, lr=self.lr, betas=(2.0, 3.0))

    with pytest.raises(ConfigError) as err, refused_while_building("optim", Record({})):
        Unchecked(lr=1e-3).build(tiny_gpt())
    assert err.value.key == "optim" and "Invalid beta parameter" in str(err.value)


def test_train_model_uses_the_same_defaults():
    from looplib import train_model
    result = train_model(tiny_gpt(), random_tokens(n=8), max_steps=1, batch_size=4, device="cpu")
    decayed, rest = result.optimizer.param_groups
    assert (decayed["lr"], decayed["betas"], decayed["eps"]) == (lo.LR, lo.BETAS, lo.EPS)
    assert (decayed["weight_decay"], rest["weight_decay"]) == (lo.WEIGHT_DECAY, 0.0)


def test_a_64_bit_seed_trains_every_epoch():
    loader = build_loader(random_tokens(n=4), batch_size=2, seed=2**64 - 1)
    epochs = iter(Epochs(loader))
    for _ in range(3):
        assert len(list(next(epochs))) == 2

"""Every registered optimizer built from its config file (Hydra's instantiate; the in-process tests: tests/unit/test_optim.py)."""
from unittest import mock
import pytest
import torch
from looplib import optim as lo

from conftest import tiny_gpt


def test_every_registered_optimizer_builds_and_steps():
    from looplib.cli.instantiate import instantiate
    from omegaconf import OmegaConf
    from importlib import resources
    assert {"adamw", "sgd", "adafactor", "adam8bit"} <= set(lo.list_optimizers())
    for name in lo.list_optimizers():
        if name == "adam8bit":
            pytest.importorskip("bitsandbytes")
        if name == "cpu_adam" and not torch.cuda.is_available():
            continue  # DeepSpeed JIT-compiles its CPU Adam (a minute on two cores): the CUDA offload tests run it
        cfg = OmegaConf.create({"lr": 1e-3, "weight_decay": 0.1})
        cfg.optim = OmegaConf.load(resources.files("looplib.conf") / "optim" / f"{name}.yaml")
        model = tiny_gpt()
        opt = instantiate(cfg, "optim").build(model)
        model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
        before = model.blocks[0].mlp[0].weight.detach().clone()
        with mock.patch("torch.compile", lambda fn, **kw: fn):  # adam8bit_ao's step: minutes to compile on a CPU
            opt.step()
        assert not torch.equal(before, model.blocks[0].mlp[0].weight), name
        assert opt.param_groups[0]["lr"] == 1e-3

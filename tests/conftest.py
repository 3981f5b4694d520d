import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import warm
import warm_ranks
from looplib.data import RandomTokens
from looplib.models import GPT

REPO = Path(__file__).resolve().parents[1]


def tiny_gpt(seed: int = 0, vocab: int = 64, seq_len: int = 16) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab_size=vocab, seq_len=seq_len, n_layer=2, n_head=2, d_model=32)


def random_tokens(n: int = 32, seq_len: int = 16, vocab: int = 64, seed: int = 0) -> RandomTokens:
    return RandomTokens(n, seq_len, vocab, seed=seed)


def has_bitsandbytes() -> bool:
    import logging
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its CPU build warns at import about a `kernels` package
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


needs_bnb = pytest.mark.skipif(not has_bitsandbytes(), reason="bitsandbytes is not installed")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def run_cli(*args: str, cwd: Path, env: dict | None = None, module: str = "looplib.train",
            timeout: int = 600, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m looplib.train ARGS`` the way a user types it: in a fork of an interpreter
    that has done its imports already (tests/warm.py; torchrun's workers too, tests/warm_ranks.py),
    or with ``fresh``, a new interpreter."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", "LOOPLIB_PLOT": "0", **(env or {})}  # no loss.png: CI time
    if not fresh and os.environ.get("LOOPLIB_TEST_FRESH", "0") == "0":
        if module == "torch.distributed.run":  # its workers too: warm ranks (tests/warm_ranks.py)
            args = warm_ranks.torchrun_args(list(args))
        return warm.run(module, args, cwd, full_env, timeout)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def no_hydra_runtime_left_behind():
    """A test that runs Hydra in this process (a multirun, compose with its runtime config) leaves
    HydraConfig set; the next test's jobs would take its sweep for theirs."""
    yield
    from hydra.core.hydra_config import HydraConfig
    HydraConfig.instance().cfg = None


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> str:
    """One tokenizer cache for every CLI test of the session."""
    return str(os.environ.get("LOOPLIB_CACHE") or tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_pretrained(tmp_path_factory) -> Path:
    """A pretrained Hugging Face directory (a tiny Llama + its BPE tokenizer), made once, offline."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'looplib[hf]')")
    from looplib.make_tiny_model import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("pretrained") / "tiny-llama", vocab_size=384, hidden_size=32,
                           layers=2, max_positions=64, max_bytes=100_000)


TRACKED_SWEEP = ["-m", "+optim=adamw,sgd", "+logger=[tensorboard,mlflow,wandb]", "data=random", "batch_size=2",
                 "model.n_layer=1", "log_every=1", "max_steps=4", "eval_every=2", "eval_samples=4", "sample_tokens=0"]


@pytest.fixture(scope="session")
def tracked_sweep(tmp_path_factory) -> Path:
    """A two-job sweep (+optim=adamw,sgd) with every tracker: tests/cli/test_loggers.py reads the
    trackers back, tests/cli/test_report.py reports on it (one sweep for both: CI time)."""
    for module in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(module)
    root = tmp_path_factory.mktemp("tracked_sweep")
    r = run_cli(*TRACKED_SWEEP, f"hydra.sweep.dir={root / 'sweep'}", cwd=root, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    return root / "sweep"


TIERS = ("unit", "cli", "dist")


def pytest_collection_modifyitems(config, items):
    """Each test carries its tier's marker, from the folder it sits in (``-m unit``, ``-m "not dist"``)."""
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(tier)

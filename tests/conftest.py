import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# One thread a process unless OMP_NUM_THREADS says otherwise: pytest-xdist runs a worker per core, and
# torch's default of a thread per core put two threads per worker on each core, spinning while they
# waited for each other (tests/unit/test_loop_reference.py on 2 cores under load: 113 s of CPU with
# two threads, 15 s with one). Set before torch is imported; the workers, their warm interpreters,
# the commands the tests start and torchrun's ranks inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
# The order files start in: the longest first, so that the two workers end together (pytest-xdist hands
# out whole files in collection order under `--dist loadfile --no-loadscope-reorder`; its default order,
# the most tests first, started one-test files such as the walkthrough last). A file's cost is its
# seconds in tests/durations.json (LOOPLIB_TEST_DURATIONS=tests/durations.json python -m pytest writes
# them afresh), else its number of tests times its tier's typical seconds a test.
DURATIONS = Path(__file__).with_name("durations.json")
SECONDS_A_TEST = {"dist": 8.0, "cli": 2.0, "unit": 0.3}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Each test carries its tier's marker, from the folder it sits in (``-m unit``, ``-m "not dist"``);
    files run longest first, each file's tests in their own order."""
    files: dict[str, list] = {}
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(tier)
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}

    def cost(name: str) -> float:
        return known.get(name, SECONDS_A_TEST.get(Path(name).parent.name, 1.0) * len(files[name]))

    items[:] = [item for name in sorted(files, key=lambda name: -cost(name)) for item in files[name]]


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each file's seconds (setup, call and teardown), for LOOPLIB_TEST_DURATIONS."""
    name = report.nodeid.split("::", 1)[0]
    _seconds[name] = _seconds.get(name, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = os.environ.get("LOOPLIB_TEST_DURATIONS")
    if path and _seconds and not hasattr(session.config, "workerinput"):  # the controller, or -n 0
        Path(path).write_text(json.dumps({k: round(v, 1) for k, v in sorted(_seconds.items())}, indent=0) + "\n")

"""The README's first command on a fresh machine: the core install, no extras, a real job.

A new virtual environment gets torch (this environment's own build, linked in rather than
copied: installing it again costs minutes of disk writes in CI), then ``pip install .`` with no extras,
and runs a short default job (data=pysource, model=tiny) that writes a checkpoint, the final
weights and a sample. Nothing from the test extra (numpy came from it once) is there to hide
a missing core dependency: any import a core run makes must come from a core dependency.
"""
import json
import os
import re
import subprocess
import sysconfig
import venv
from importlib.metadata import distribution
from pathlib import Path

import pytest

from conftest import REPO

EXTRAS = ("transformers", "peft", "bitsandbytes", "deepspeed", "matplotlib", "pytest", "tensorboard", "mlflow",
          "wandb")


@pytest.mark.slow
def test_core_install_runs_the_default_job(tmp_path, token_cache):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def pip(*args):
        r = subprocess.run([python, "-m", "pip", "install", "--quiet", *args], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=900)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

    link_torch(tmp_path / "torch-site", env_dir)  # what `pip install torch==2.13.0` would put there
    pip(str(REPO))                                 # core dependencies only
    absent = subprocess.run([python, "-c", "import importlib.util as u; print([m for m in %r if u.find_spec(m)])"
                             % (EXTRAS,)], capture_output=True, text=True, env=env)
    assert absent.stdout.strip() == "[]", absent.stdout + absent.stderr  # really no extras

    elsewhere, run_dir = tmp_path / "elsewhere", tmp_path / "elsewhere" / "run"
    elsewhere.mkdir()
    r = subprocess.run([python, "-m", "looplib.train", "max_steps=2", "batch_size=2", "eval_samples=4",
                        "sample_tokens=8", "checkpoint.every_steps=1", f"hydra.run.dir={run_dir}"],
                       capture_output=True, text=True, cwd=elsewhere, timeout=600,
                       env={**env, "LOOPLIB_CACHE": token_cache, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "a sample from the trained model" in r.stdout
    assert (run_dir / "model.safetensors").stat().st_size > 0
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-00000001", "step-00000002"]
    assert all((c / "manifest.json").is_file() and (c / "model.safetensors").is_file() for c in ckpts)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2


def link_torch(shared: Path, env_dir: Path) -> None:
    """Make torch and its own dependencies (not numpy, not looplib's) importable in the new
    environment through a .pth file: symlinks to this environment's files, metadata included,
    so that pip sees torch installed. Outside the new environment, pip never uninstalls them."""
    shared.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        dist = distribution(todo.pop())
        name = dist.metadata["Name"].lower()
        if name in seen or name in ("setuptools", "pip"):
            continue
        seen.add(name)
        todo += [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in dist.requires or () if "extra ==" not in r]
        for top in {Path(str(f)).parts[0] for f in dist.files or ()} - {"..", "bin"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (shared / top).exists():
                (shared / top).symlink_to(source)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}))
    (site / "torch-from-this-machine.pth").write_text(str(shared) + "\n")

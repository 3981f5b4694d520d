"""A plain pip install run from another directory finds its config (the in-process tests: tests/unit/test_packaging.py)."""
import json
import os
import subprocess
import sys
import pytest

from conftest import REPO


@pytest.mark.slow
def test_plain_install_finds_the_packaged_config(tmp_path):
    target = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--no-build-isolation", "--target", str(target), str(REPO)],
                           capture_output=True, text=True, cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    assert (target / "looplib" / "conf" / "precision" / "bf16.yaml").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}  # ahead of the editable install
    where = subprocess.run([sys.executable, "-c", "import looplib; print(looplib.__file__)"],
                           capture_output=True, text=True, cwd=elsewhere, env=env)
    assert where.stdout.startswith(str(target)), where.stdout + where.stderr
    found = subprocess.run([sys.executable, "-c", "from hydra.core.plugins import Plugins; from hydra.plugins.sweeper "
                            "import Sweeper; import inspect; print([inspect.getfile(c) for c in "
                            "Plugins.instance().discover(Sweeper) if c.__name__ == 'OptunaSweeper'])"],
                           capture_output=True, text=True, cwd=elsewhere, env=env)  # hydra/sweeper=optuna's plugin
    assert found.stdout.startswith(f"['{target}/hydra_plugins/looplib_optuna/"), found.stdout + found.stderr
    run_dir = elsewhere / "run"
    r = subprocess.run([sys.executable, "-m", "looplib.train", "+precision=bf16", "data=random",
                        "max_steps=2", "batch_size=2", "eval_samples=4", "sample_tokens=0",
                        f"hydra.run.dir={run_dir}"], capture_output=True, text=True, cwd=elsewhere, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2

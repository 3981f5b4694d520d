"""A plain pip install run from another directory finds its config, and the wheel and sdist carry every
file of conf/ with no list of its folders (the in-process tests: tests/unit/test_packaging.py)."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

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


def build(kind: str, source, out) -> str:
    """Build a wheel or an sdist of ``source`` into ``out`` through the PEP 517 hook that pip and
    ``python -m build`` call (setuptools' build_meta, offline, no isolation); the file's name."""
    r = subprocess.run([sys.executable, "-c", f"import setuptools.build_meta as b; print(b.build_{kind}({str(out)!r}))"],
                       capture_output=True, text=True, cwd=source, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "is absent from the `packages` configuration" not in r.stderr  # setuptools' warning per data folder
    return r.stdout.strip().splitlines()[-1]


def test_a_new_conf_group_ships_in_the_wheel_and_sdist_with_no_pyproject_edit(tmp_path):
    """A copy of what the build reads, with a group folder pyproject.toml has never heard of
    (conf/zz_new_group/, one level deeper too, as conf/hydra/launcher/): the wheel built from the tree
    and the one built from the sdist hold every conf/**/*.yaml as looplib/conf/..., and every
    module of looplib (a package missing from pyproject's list is absent from a plain install)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", pyproject["project"]["readme"]):
        shutil.copy(REPO / name, source / name)
    for folder in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (source / "conf" / "zz_new_group" / "deeper").mkdir(parents=True)
    (source / "conf" / "zz_new_group" / "an_option.yaml").write_text("# python -m looplib.train +zz_new_group=an_option\n")
    (source / "conf" / "zz_new_group" / "deeper" / "more.yaml").write_text("x: 1\n")
    conf = {"looplib/conf/" + p.relative_to(source / "conf").as_posix() for p in (source / "conf").rglob("*.yaml")}
    modules = {p.relative_to(source).as_posix() for p in (source / "looplib").rglob("*.py")}
    assert "looplib/conf/zz_new_group/deeper/more.yaml" in conf and "looplib/conf/hydra/launcher/slurm.yaml" in conf

    out = tmp_path / "out"
    from_tree = zipfile.ZipFile(out / build("wheel", source, out)).namelist()
    sdist = out / build("sdist", source, out)
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    [unpacked] = (tmp_path / "unpacked").iterdir()
    (tmp_path / "out2").mkdir()
    from_sdist = zipfile.ZipFile(tmp_path / "out2" / build("wheel", unpacked, tmp_path / "out2")).namelist()
    for names in (from_tree, from_sdist):
        assert conf - set(names) == set(), "conf/ files missing from the wheel"
        assert {n for n in names if n.startswith("looplib/conf/") and n.endswith(".yaml")} == conf
        assert modules - set(names) == set(), "looplib modules missing from the wheel: list their package in pyproject.toml"
        assert "hydra_plugins/looplib_optuna/__init__.py" in names

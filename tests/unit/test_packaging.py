"""conf/ is found from a plain (non-editable) install too, whatever the working directory."""


from conftest import REPO


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    lines = [line.strip() for line in (REPO / "README.md").read_text().splitlines()[1:6] if line.strip()]
    install_and_run, install_and_test = lines[0], lines[1]
    assert install_and_run.endswith("python -m looplib.train") and install_and_run.startswith("pip install")
    assert "pytest" in install_and_test and install_and_test.startswith("pip install")
    assert install_and_test in (REPO / ".ci" / "run").read_text().splitlines()


def test_every_package_of_looplib_is_in_the_wheel():
    """A package missing from pyproject's list works from the editable install and is absent
    from a plain ``pip install .`` (looplib.loggers and looplib.plan once were)."""
    import tomllib
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "looplib").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert found - listed == set()

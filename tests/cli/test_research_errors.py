"""Bad input to the research strategies: one line naming the key, exit 2, no run directory."""
import pytest

from conftest import run_cli

BAD = [
    (["+compile=default", "compile.mode=fastest"], "compile.mode"),
    (["+evaluation=bf16", "evaluation.dtype=float64"], "evaluation.dtype"),
    (["+peft=lora", "peft.r=0"], "peft.r"),
]


def one_line_error(r, key, run_dir):
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"looplib: error: {key}"), lines[0]
    assert "Traceback" not in r.stderr and not run_dir.exists()
    return lines[0]


@pytest.mark.parametrize("args,key", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_research_settings(tmp_path, args, key):
    if key.startswith("peft"):
        pytest.importorskip("peft")
    run_dir = tmp_path / "run"
    one_line_error(run_cli(*args, "data=random", f"hydra.run.dir={run_dir}", cwd=tmp_path), key, run_dir)


def test_unknown_transformers_model_type(tmp_path):
    pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    r = run_cli("model=llama_tiny", "model.model_type=no-such-arch", "data=random", f"hydra.run.dir={run_dir}",
                cwd=tmp_path)
    one_line_error(r, "model.model_type", run_dir)


@pytest.mark.parametrize("package,args,extra", [
    ("peft", ["+peft=lora"], "looplib[peft]"),
    ("transformers", ["model=llama_tiny"], "looplib[hf]"),
])
def test_missing_optional_library_names_the_extra(tmp_path, package, args, extra):
    fake = tmp_path / "fake" / package
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError('No module named {package}')\n")
    run_dir = tmp_path / "run"
    r = run_cli(*args, "data=random", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                env={"PYTHONPATH": str(tmp_path / "fake")})
    line = one_line_error(r, args[0].split("=")[0].lstrip("+"), run_dir)
    assert f"pip install '{extra}'" in line

"""scripts/bench_time_to_loss.py in its tiny mode (the code path, not the figure), and the command line
scripts/gpu_figures.sh's time_to_loss part runs, at the tiny size on the CPU."""
import importlib.util
import json
import re
import shlex

import pytest

from conftest import REPO, run_cli

spec = importlib.util.spec_from_file_location("bench_time_to_loss", REPO / "scripts" / "bench_time_to_loss.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def warm(args, run_dir, env):
    """The benchmark's runner, in the tests' warm interpreter (tests/warm.py): seconds, not minutes."""
    r = run_cli(*args, cwd=run_dir.parent, env={"OMP_NUM_THREADS": env["OMP_NUM_THREADS"]})
    bench.log_of(run_dir).write_text(r.stdout + r.stderr)
    return r.returncode


def test_tiny_mode_writes_the_table_the_chart_and_the_ratios(tmp_path):
    out = tmp_path / "out"
    results = bench.main(["--tiny", "--jobs", "default", "--seeds", "2", "--lrs", "5e-3,1e-2", "--out", str(out),
                          "--work", str(tmp_path / "work")], runner=warm)
    res = results[0]
    data = json.loads((out / "time_to_loss.json").read_text())
    assert len(data["runs"]) == 4 * 2 + 4 * 1  # the search (2 lrs, seed 0), then seed 1 at each best lr
    assert list(res["summary"]) == list(bench.RECIPES) and res["summary"]["adamw+cosine"]["steps_ratio"] == 1.0
    for recipe, per_seed in res["per_seed"].items():
        best = res["best_lr"][recipe]
        assert best == float(min(res["search"][recipe], key=res["search"][recipe].get))
        for row in per_seed:  # the target: the baseline's last eval loss on the same seed
            run = data["runs"][f"default {recipe} lr={best:g} seed={row['seed']}"]
            baseline = data["runs"][f"default adamw+cosine lr={res['best_lr']['adamw+cosine']:g} seed={row['seed']}"]
            assert row["target"] == baseline["eval_loss"][-1]
            assert run["steps"] == list(range(2, 17, 2)) and run["load_before"] >= 0  # evaluated every 2 steps
            if row["steps"] is not None:
                first = next(s for s, loss in zip(run["steps"], run["eval_loss"]) if loss <= row["target"])
                assert row["steps"] == first and row["seconds"] == run["seconds"][run["steps"].index(first)]
    table = (out / "time_to_loss.md").read_text()
    assert "| recipe | lr (best of search) | reached | steps to target | x steps |" in table
    assert table.count("| muon+wsd |") == 2 and "Load average (1 min)" in table
    if importlib.util.find_spec("matplotlib"):
        assert (out / "time_to_loss.png").stat().st_size > 10_000
    # a second call continues: every run is already recorded, nothing runs again
    assert bench.main(["--tiny", "--jobs", "default", "--seeds", "2", "--lrs", "5e-3,1e-2", "--out", str(out),
                       "--work", str(tmp_path / "work")], runner=lambda *a: pytest.fail("ran again"))[0] == res


def test_the_gpu_figure_command_line_runs_at_the_tiny_size(tmp_path):
    script = (REPO / "scripts" / "gpu_figures.sh").read_text()
    line = re.search(r"time_to_loss\) part time_to_loss \d+ \$py scripts/bench_time_to_loss.py (.*?) --out", script,
                     re.S).group(1)
    argv = shlex.split(line.replace("\\\n", " "))
    results = bench.main([*argv, "--tiny", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                         runner=warm)
    assert [r["job"] for r in results] == ["gpt2"]
    assert set(results[0]["summary"]) == set(results[0]["search"]) == {"adamw+cosine", "muon+wsd"}

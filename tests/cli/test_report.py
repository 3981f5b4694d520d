"""python -m looplib.report turns a small real multirun (made by the CLI) into a table, a CSV and a chart."""
import csv
import json

import pytest

from conftest import run_cli


def test_report_of_a_real_multirun(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "+optim=adamw,sgd", "+precision=fp32,bf16", "data=random", "max_steps=3", "batch_size=2",
                "model.n_layer=1", "log_every=1", "eval_samples=4", "sample_tokens=0",
                f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (sweep / "3" / "metrics.jsonl").unlink()  # a job that died before writing metrics
    r = run_cli(str(sweep), module="looplib.report", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    md = (sweep / "report.md").read_text()
    assert r.stdout.startswith(md)
    assert "Every job: `data=random max_steps=3" in md
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| job | +optim | +precision | steps | final loss | eval loss | tokens/s")
    assert [line.split(" | ")[1:3] for line in lines[1:]] == [
        ["adamw", "fp32"], ["adamw", "bf16"], ["sgd", "fp32"], ["sgd", "bf16"]]
    assert lines[-1].endswith("| no metrics (failed or still running) |")

    rows = list(csv.DictReader((sweep / "report.csv").read_text().splitlines()))
    assert len(rows) == 4
    for row in rows[:3]:  # every number read back from the job's own metrics.jsonl
        metrics = [json.loads(x) for x in (sweep / row["job"] / "metrics.jsonl").read_text().splitlines()]
        train = [m for m in metrics if "loss" in m]
        assert float(row["final loss"]) == pytest.approx(train[-1]["loss"], rel=1e-12)
        assert float(row["eval loss"]) == pytest.approx([m for m in metrics if "eval_loss" in m][-1]["eval_loss"])
        assert int(row["steps"]) == 3 and int(row["skipped steps"]) == 0
        tps = sorted(m["tokens_per_s"] for m in train[1:])
        assert float(row["tokens/s"]) == pytest.approx(tps[len(tps) // 2] if len(tps) % 2 else sum(tps) / 2)
        assert float(row["peak memory MB"]) == max(m["peak_mem_mb"] for m in train)
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_an_empty_directory_is_one_line(tmp_path):
    r = run_cli(str(tmp_path), module="looplib.report", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("looplib.report: error: no job directories")
    r = run_cli(str(tmp_path / "nowhere"), module="looplib.report", cwd=tmp_path)  # a mistyped path
    assert r.returncode == 2 and r.stderr.strip().startswith(f"looplib.report: error: {tmp_path / 'nowhere'} is "
                                                             "not a directory; give a sweep's directory"), r.stderr
    assert not (tmp_path / "nowhere").exists()


def test_report_says_what_memory_measures_with_spread_and_curves(tracked_sweep, tmp_path):
    """On a real two-job sweep: per-job memory (and what it measures), throughput min/median/max
    from the job's own rows, and a chart whose loss axes start near the data, with a curves panel
    holding every job's training and held-out loss."""
    from looplib import report
    out = tmp_path / "out"
    r = run_cli(str(tracked_sweep), "--out", str(out), module="looplib.report", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    md = (out / "report.md").read_text()
    assert ("peak memory MB (every job): process resident memory (RSS), peak during this job (the peak is reset "
            "when the job starts") in md
    assert "eval accuracy" not in md  # a language-model sweep: no empty accuracy column
    rows = {row["job"]: row for row in csv.DictReader((out / "report.csv").read_text().splitlines())}
    for job in ("0", "1"):
        train = [m for m in map(json.loads, (tracked_sweep / job / "metrics.jsonl").read_text().splitlines())
                 if "loss" in m]
        assert train[0]["peak_mem_measures"].startswith("process resident memory")
        tps = [m["tokens_per_s"] for m in train[1:]]
        assert float(rows[job]["tokens/s min"]) == pytest.approx(min(tps))
        assert float(rows[job]["tokens/s max"]) == pytest.approx(max(tps))
        assert min(tps) <= float(rows[job]["tokens/s"]) <= max(tps)
        assert float(rows[job]["peak memory MB"]) == max(m["peak_mem_mb"] for m in train)

    drawn = report.chart(report.collect(tracked_sweep), tmp_path / "chart.png")
    assert drawn["curves"] == ["optim=adamw (training)", "optim=adamw (held-out)",
                               "optim=sgd (training)", "optim=sgd (held-out)"]
    losses = [j.metrics[k] for j in report.collect(tracked_sweep) for k in ("final_loss", "eval_loss")]
    low, high = drawn["ylim"]["final_loss"]
    assert min(losses) - (max(losses) - min(losses)) <= low < min(losses) and high > max(losses)  # not from 0
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

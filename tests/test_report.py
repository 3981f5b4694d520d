"""python -m looplib.report turns a small real multirun (made by the CLI) into a table, a CSV and a chart."""
import csv
import json

import pytest

from conftest import run_cli


def test_report_of_a_real_multirun(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "+optim=adamw,sgd", "+precision=fp32,bf16", "data=random", "max_steps=3", "batch_size=2",
                "model.n_layer=1", "log_every=1", "eval_batches=1", "sample_tokens=0",
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

"""The report of a classification sweep, from files written in-process (the tests on a real multirun: tests/cli/test_report.py)."""
import json


def test_classification_sweeps_show_accuracy(tmp_path):
    from looplib import report
    for n, (acc, loss) in enumerate([(0.5, 0.69), (0.75, 0.55)]):
        job = tmp_path / str(n)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- data=classification\n- lr={n + 1}e-3\n")
        (job / "metrics.jsonl").write_text(
            json.dumps({"step": 1, "loss": 0.7, "sequences_per_s": 10.0, "peak_mem_mb": 5.0}) + "\n"
            + json.dumps({"step": 2, "loss": loss, "sequences_per_s": 12.0 + n, "peak_mem_mb": 5.0}) + "\n"
            + json.dumps({"step": 3, "loss": loss, "sequences_per_s": 14.0, "peak_mem_mb": 5.0}) + "\n"
            + json.dumps({"step": 2, "eval_loss": loss, "eval_accuracy": acc}) + "\n")
    written = report.report(tmp_path)
    md = written["md"].read_text()
    header = [line for line in md.splitlines() if line.startswith("| job")][0]
    assert "| eval accuracy |" in header and "| sequences/s | sequences/s min | sequences/s max |" in header
    assert "tokens/s" not in header  # a classification run counts sequences
    assert [line.split(" | ")[5] for line in md.splitlines() if line.startswith("| 0") or line.startswith("| 1")] == [
        "0.5000", "0.7500"]
    drawn = report.chart(report.collect(tmp_path), tmp_path / "c.png")
    assert "eval_accuracy" in drawn["ylim"] and "sequences_per_s" in drawn["ylim"]
    assert [line for line in md.splitlines() if line.startswith("| 1")][0].split(" | ")[6:9] == ["13.5", "13.0", "14.0"]

"""Metrics rows hold the promised keys, and the throughput agrees with steps x batch / time."""
import io
import json
import logging
import sys

import pytest
import torch

from looplib import optim as lo
from looplib.data import build_loader
from looplib.loop import fit
from looplib.loss import TokenCrossEntropy
from looplib.telemetry import Telemetry

from conftest import random_tokens, tiny_gpt


def test_metrics_rows_and_throughput(tmp_path):
    path = tmp_path / "metrics.jsonl"
    model = tiny_gpt()
    loader = build_loader(random_tokens(n=64), batch_size=4, seed=0)
    telemetry = Telemetry(path, log_every=4, total_steps=12, progress="lines")
    fit(model, loader, objective=TokenCrossEntropy(), optimizer=lo.AdamW(lr=1e-3).build(model),
        max_steps=12, telemetry=telemetry, max_grad_norm=1.0)
    telemetry.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 4, 8, 12]
    for r in rows:
        assert {"step", "epoch", "loss", "lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s",
                "skipped_steps", "peak_mem_mb", "elapsed_s"} <= set(r)
        assert r["skipped_steps"] == 0 and r["peak_mem_mb"] > 0
    # every step holds 4 sequences of 16 tokens; each row covers the steps since the last one
    for r in rows:
        assert r["samples_per_s"] == pytest.approx(4 / r["step_time_s"], rel=1e-6)
        assert r["tokens_per_s"] == pytest.approx(16 * r["samples_per_s"], rel=1e-6)
    steps = [r["step"] - p for p, r in zip([0] + [r["step"] for r in rows[:-1]], rows)]
    assert steps == [1, 3, 4, 4]
    total = sum(r["step_time_s"] * n for r, n in zip(rows, steps))
    assert total <= rows[-1]["elapsed_s"] and total == pytest.approx(rows[-1]["elapsed_s"], rel=0.1)


def test_evaluations_are_timed_and_left_out_of_the_throughput(tmp_path):
    """Each evaluation row carries eval_s, and the next interval's step time leaves it out: steps
    plus evaluations account for the elapsed time. The first row says when training started, and
    a compiled run's rows carry its compile seconds so far (looplib.tune reads them)."""
    import time
    path = tmp_path / "metrics.jsonl"
    model = tiny_gpt()
    before = time.time()
    telemetry = Telemetry(path, log_every=4, total_steps=12, progress="lines")
    telemetry.compiled = lambda: {"compile_s": 1.5, "compiles": 2}

    def slow_evaluation(*args):
        time.sleep(0.2)
        return 1.0
    fit(model, build_loader(random_tokens(n=64), batch_size=4, seed=0), objective=TokenCrossEntropy(),
        optimizer=lo.AdamW(lr=1e-3).build(model), max_steps=12, telemetry=telemetry, eval_data=[None],
        eval_every=4, evaluator=slow_evaluation)
    telemetry.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]
    assert before <= rows[0]["started_at"] <= time.time() and "started_at" not in rows[1]
    assert [r["step"] for r in evals] == [4, 8, 12] and all(r["eval_s"] >= 0.2 for r in evals)
    assert all(r["compile_s"] == 1.5 and r["compiles"] == 2 for r in rows)
    counts = [r["step"] - p for p, r in zip([0] + [r["step"] for r in steps[:-1]], steps)]
    accounted = sum(r["step_time_s"] * n for r, n in zip(steps, counts)) + sum(r["eval_s"] for r in evals[:-1])
    assert accounted == pytest.approx(steps[-1]["elapsed_s"], rel=0.1)


def test_each_job_gets_its_own_memory_peak(tmp_path):
    """A sweep runs its jobs in one process: the peak is reset when a job's Telemetry starts, so a
    small job after a big one does not inherit the big one's peak (CPU: the process's peak RSS)."""
    from looplib.telemetry import peak_memory_mb
    big = torch.ones(400 * 2**20 // 4)  # 400 MB, touched
    del big
    before = peak_memory_mb(torch.device("cpu"))
    telemetry = Telemetry(tmp_path / "m.jsonl", progress="lines")
    assert "peak during this job" in telemetry._memory
    assert peak_memory_mb(torch.device("cpu")) < before - 300
    telemetry.close()


def test_log_lines_print_above_the_bar_not_through_it(monkeypatch):
    """On a terminal, a log line written while the bar is shown (Hydra's console handler) clears the
    bar's line first and the bar is redrawn below it; before, it was glued to the bar's text."""
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", screen)
    console = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(console)
    try:
        telemetry = Telemetry(None, total_steps=2, progress="bar")
        logging.getLogger("looplib").warning("a line while the bar is shown")
        telemetry.close()
        assert console in logging.getLogger().handlers  # the redirection ends with the bar
    finally:
        logging.getLogger().removeHandler(console)
    out = screen.getvalue()
    assert "\ra line while the bar is shown\n" in out and "]a line" not in out, repr(out)


def test_the_training_bar_shows_on_a_terminal_that_reports_no_size(tmp_path, monkeypatch):
    """A pseudo-terminal of size 0 x 0 (under `script`, many CI runners) made tqdm hide the training
    bar (0 rows); it now gets 100 x 24, as the data's bars do (looplib.data.progress.bar_size)."""
    import os
    from looplib.data.progress import bar_size
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((0, 0)))
    assert bar_size() == {"dynamic_ncols": False, "ncols": 100, "nrows": 24}
    telemetry = Telemetry(tmp_path / "m.jsonl", total_steps=3, progress="bar")
    try:
        assert telemetry.bar is not None and telemetry.bar.ncols == 100 and telemetry.bar.nrows == 24
    finally:
        telemetry.bar.close()
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((120, 40)))
    assert bar_size() == {"dynamic_ncols": True, "ncols": None, "nrows": None}

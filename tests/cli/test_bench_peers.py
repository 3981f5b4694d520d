"""scripts/bench_peers.py, the side-by-side benchmark: its tiny CPU mode runs and writes the table
and JSON the GPU run will, looplib on the Trainer's exact job ends on the Trainer's losses, the
ratios are looplib's figures over each peer's, and every GPU row's command line composes."""
import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "peers"))

ROW_KEYS = {"workload", "framework", "tokens_per_s", "peak_mem_mb", "loss", "settings", "status"}


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the HF Trainer needs transformers")
def test_tiny_run_writes_the_table_and_looplib_ends_on_the_trainers_losses(tmp_path):
    """One workload, three rows: looplib on the Trainer's settings and model (looplib_same), the HF
    Trainer, torchtitan (GPU only: a row that says why). Same initial weights (one file), same rows
    in the same order, fp32 on the CPU: the losses agree to 1e-6 (they were bit-equal when this
    was written, for all three workloads). A real difference is far larger at the tiny job's step
    size (lr 1e-2): the Trainer with beta2 0.999 instead of 0.95 ended 3.3e-5 away, with clipping at
    0.5 instead of 1.0, 1.6e-4; a shifted label or another order changes the first loss."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_peers.py"), "--tiny", "--workloads", "pretrain",
                        "--frameworks", "looplib_same,hf_trainer,torchtitan", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((out / "peers.json").read_text())
    assert data["device"].startswith("cpu") and data["tiny"] is True
    rows = {row["framework"]: row for row in data["rows"]}
    assert set(rows) == {"looplib_same", "hf_trainer", "torchtitan"}
    for row in data["rows"]:
        assert ROW_KEYS <= set(row) and row["workload"] == "pretrain", row
    ours, trainer = rows["looplib_same"], rows["hf_trainer"]
    assert ours["status"] == trainer["status"] == "ok", (ours, trainer)
    for key in ("loss", "first_loss"):
        assert ours[key] == pytest.approx(trainer[key], rel=1e-6), key
    assert ours["first_loss"] != ours["loss"]  # it trained
    for row in (ours, trainer):
        assert row["tokens_per_s"] > 0 and row["peak_mem_mb"] > 0 and row["timed_steps"] == 3
    assert "+optim=adamw optim.impl=for-loop" in ours["settings"] and "adamw_torch" in trainer["settings"]
    titan = rows["torchtitan"]
    if importlib.util.find_spec("torchtitan") is None:
        assert titan["status"] == "not run" and "torchtitan is not installed" in titan["reason"]
    else:
        assert titan["status"] == "not run" and "accelerator only" in titan["reason"]
    assert titan["tokens_per_s"] is None and "Float8" in titan["settings"]
    assert data["ratios"] == {}  # no row named looplib here: ratios are looplib's best over each peer
    table = (out / "peers.md").read_text()
    assert "| looplib_same | ok |" in table and "| torchtitan | not run: " in table and "(--tiny: " in table


def test_ratios_are_looplibs_figures_over_each_peers_with_the_record_line():
    from bench_peers import markdown, ratios
    rows = [dict(workload="gpt2", framework="looplib", status="ok", tokens_per_s=500_000.0, peak_mem_mb=30_000.0,
                 loss=7.0, settings="a"),
            dict(workload="gpt2", framework="hf_trainer", status="ok", tokens_per_s=250_000.0, peak_mem_mb=40_000.0,
                 loss=7.1, settings="b"),
            dict(workload="gpt2", framework="other", status="failed", reason="boom", tokens_per_s=None,
                 peak_mem_mb=None, loss=None, settings="c")]
    got = ratios(rows)
    assert got["gpt2"]["hf_trainer"] == {"speed_x": 2.0, "memory_x": 0.75} and "other" not in got["gpt2"]
    assert got["gpt2"]["record"]["tokens_per_s"] == 468_000
    assert got["gpt2"]["record"]["speed_x"] == pytest.approx(500_000 / 468_000)
    assert ratios([dict(r, tiny=True) for r in rows])["gpt2"].get("record") is None  # tiny shapes: no record line
    text = markdown({"device": "NVIDIA H100", "command": "bench_peers.py", "date": "today", "rows": rows,
                     "ratios": got})
    assert "| hf_trainer | ok | 250,000 | 2.00 | 40,000 | 0.75 | 7.1000 | b |" in text
    assert "| other | failed: boom | - |" in text and "| llm.c (per H100, its published rate) | record | 468,000 | 1.07 |" in text
    assert ratios([dict(rows[1])]) == {}  # without looplib's row there is nothing to divide


@pytest.mark.parametrize("workload", ["pretrain", "gpt2", "qlora"])
def test_every_gpu_command_line_of_looplib_composes(workload, tmp_path):
    """The GPU rows' looplib command lines (full shapes, every override) compose with Hydra: a
    misspelt group or key fails here, not on the GPU."""
    from hydra import compose, initialize_config_module

    from bench_peers import LOOPLIB, looplib_command, settings_of
    from spec import job
    spec = dict(job(workload, tiny=False), device="cuda")
    for framework in ("looplib", "looplib_same"):
        spec["framework"] = framework
        overrides, words = settings_of(framework, workload, spec, tiny=False)
        if framework == "looplib":
            assert overrides == LOOPLIB[workload] and words.startswith(" ".join(overrides))
        args = looplib_command(workload, spec, overrides, tmp_path / "run", tmp_path / "model", tmp_path / "data")
        config_dir = args[args.index("--config-dir") + 1]
        given = [a for a in args[4:] if a != "--config-dir" and a != config_dir]
        with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"hydra.searchpath=[file://{config_dir}]", *given])
        assert cfg.batch_size == spec["micro_batch"] and cfg.accum_steps == spec["accum"]
        assert cfg.max_steps == spec["steps"] and cfg.seed == spec["seed"] and cfg.weight_decay == 0.0
        assert cfg.model.seq_len == spec["seq_len"] and cfg.data.path == str(tmp_path / "data")
        if workload == "qlora":
            assert cfg.peft.r == 16 and list(cfg.peft.target_modules) == spec["lora"]["target_modules"]
        if workload == "gpt2" and framework == "looplib":
            assert cfg.model._target_ == "looplib.models.GPT" and cfg.model.d_model == 768 and cfg.model.n_layer == 12


def test_gpu_figures_calls_each_fit_one_device_call_and_name_real_rows(tmp_path):
    """The GPU figures as the device calls docs/testing.md gives them (`speed`; `peers_gpt2
    peers_qlora`; `peers_pretrain`) as dry runs (DRY=1: each part's limit and command, nothing
    run): each call's limits add up to under the 560 s a 600 s call leaves after the wheels'
    install, `peers` alone runs every workload, and every row, workload and flag a part names
    exists in its script, so the GPU's minutes are not lost to a typo."""
    import re
    import shlex

    import bench_guides
    import bench_mfu
    from spec import WORKLOADS

    def dry(*names):
        r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_figures.sh"), str(tmp_path / "out"), *names],
                           capture_output=True, text=True, env={"DRY": "1", "PATH": "/usr/bin:/bin"}, cwd=REPO,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        found = re.findall(r"^part (\S+) (\d+)s: (.*)$", r.stdout, re.M)
        total = sum(int(p[1]) for p in found)
        assert f"limits of the parts run: {total}s in all" in r.stdout
        return found, total

    parts = []
    for call, expect in ((["speed"], ["speed_ladder", "speed_bert"]),
                         (["peers_gpt2", "peers_qlora"], ["peers_gpt2", "peers_qlora"]),
                         (["peers_pretrain"], ["peers_pretrain"]), (["peers_dpo"], ["peers_dpo"])):
        found, total = dry(*call)
        assert [p[0] for p in found] == expect and total <= 560, (call, total)
        parts += found
    assert [p[0] for p in dry("peers")[0]] == ["peers_gpt2", "peers_qlora", "peers_pretrain"]
    for name, limit, command in parts:
        args = shlex.split(command)
        script = REPO / args[1]
        flags = set(re.findall(r'add_argument\("(--[a-z-]+)"', script.read_text()))
        assert {a for a in args[2:] if a.startswith("--")} <= flags, (name, flags)
        value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
        if script.name == "bench_mfu.py":
            assert set(value("--rows").split(",")) <= set(bench_mfu.GPU_ROWS) and "--best" in args
            assert float(value("--budget-s")) < int(limit)
        elif script.name == "bench_guides.py":
            assert set(value("--rows").split(",")) <= set(bench_guides.ROWS)
        else:
            assert script.name == "bench_peers.py" and value("--workloads") in WORKLOADS
            assert float(value("--budget-s")) < int(limit) and value("--out").endswith("/out/peers")


def test_the_ladders_best_combination_of_every_option_composes_and_builds():
    """--best combines every option that beat the compiled row; with all of them (the fastest loss,
    the compiled optimizer step, CUDA graphs, micro-batch 16, the faster fp8 recipe) the command
    line still composes and each strategy builds (GPU-only ones may be refused for want of a GPU)."""
    import torch
    from hydra import compose, initialize_config_module

    import bench_mfu
    from looplib.cli.instantiate import check_settings, fill_strategy_defaults, instantiate
    from looplib.errors import ConfigError
    rows = ["compile", "compile_loss", "liger", "compile_optimizer", "reduce_overhead", "batch16", "fp8", "fp8_rowwise"]
    speed = {"compile": 100, "compile_loss": 102, "liger": 104, "compile_optimizer": 103, "reduce_overhead": 110,
             "batch16": 105, "fp8": 111, "fp8_rowwise": 112}
    overrides, taken = bench_mfu.best_row([{"row": r, "status": "ok", "tokens_per_s": speed[r]} for r in rows])
    assert taken == ["liger", "compile_optimizer", "reduce_overhead", "batch16", "fp8_rowwise"]
    assert len({o.partition("=")[0].lstrip("+") for o in overrides}) == len(overrides)  # one value per key
    assert bench_mfu.best_row([{"row": "compile", "status": "ok", "tokens_per_s": 100},
                               {"row": "liger", "status": "ok", "tokens_per_s": 100.5}])[1] == []  # within 1%
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*bench_mfu.GPU_JOB, *overrides, "device=cpu"])
    check_settings(cfg)
    fill_strategy_defaults(cfg)
    assert cfg.compile.mode == "reduce-overhead" and cfg.compile.optimizer and cfg.optim.impl == "foreach"
    assert cfg.precision.recipe == "rowwise" and cfg.batch_size == 16 and cfg.loss._target_.endswith("Liger" "TokenCrossEntropy")
    for group in ("precision", "optim", "compile", "loss"):
        try:
            instantiate(cfg, group)
        except ConfigError as err:
            assert not torch.cuda.is_available() and ("CUDA" in str(err) or "GPU" in str(err)), (group, err)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL's DPOTrainer needs trl (the test extra)")
def test_tiny_dpo_workload_runs_looplib_and_trl_on_the_same_pairs_and_reports_pairs_per_s(tmp_path):
    """The dpo workload: looplib's loss=dpo and TRL's DPOTrainer on one model directory (one
    tokenizer, one set of weights), the same pairs, global batch and steps; both start at ln 2
    (the policy is its reference), both train, and the table gives pairs/s and looplib's ratio."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_peers.py"), "--tiny", "--workloads", "dpo",
                        "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((out / "peers.json").read_text())
    rows = {row["framework"]: row for row in data["rows"]}
    assert set(rows) == {"looplib", "trl"}  # no looplib_same: TRL is the peer here
    ours, trl = rows["looplib"], rows["trl"]
    assert ours["status"] == trl["status"] == "ok", (ours, trl)
    for row in (ours, trl):
        assert ROW_KEYS <= set(row) and row["workload"] == "dpo" and row["global_batch"] == 8
        assert row["first_loss"] == pytest.approx(0.6931472, abs=1e-6) and row["loss"] != row["first_loss"]
        assert row["pairs_per_s"] == pytest.approx(8 / row["median_step_s"]) and row["peak_mem_mb"] > 0
        assert row["timed_steps"] == 8  # 12 steps, 4 of warm-up
    assert "loss=dpo" in ours["command"] and "data=preference" in ours["command"] and "DPOConfig" in trl["settings"]
    ratio = data["ratios"]["dpo"]["trl"]
    assert ratio["speed_x"] == pytest.approx(ours["pairs_per_s"] / trl["pairs_per_s"])
    assert ratio["memory_x"] == pytest.approx(ours["peak_mem_mb"] / trl["peak_mem_mb"])
    assert "| framework | status | pairs/s |" in (out / "peers.md").read_text()


def test_the_gpu_dpo_command_line_of_looplib_composes(tmp_path):
    from hydra import compose, initialize_config_module

    import dpo
    from bench_peers import LOOPLIB, settings_of
    from spec import job
    spec = dict(job("dpo", tiny=False), device="cuda", framework="looplib", model_dir=str(tmp_path / "model"),
                data_dir=str(tmp_path / "data"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": 8192}))
    overrides, _ = settings_of("looplib", "dpo", spec, tiny=False)
    assert overrides == LOOPLIB["dpo"] and "+precision=bf16" in overrides
    args = dpo.looplib_command(spec, overrides, tmp_path / "run")
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=args[3:])
    assert cfg.loss._target_ == "looplib.preference.DPO" and cfg.loss.beta == dpo.BETA
    assert cfg.batch_size * cfg.accum_steps == spec["global_batch"] and cfg.max_steps == spec["steps"]
    assert cfg.data.path == str(tmp_path / "data" / "pairs.jsonl") and cfg.model.seq_len == 1024

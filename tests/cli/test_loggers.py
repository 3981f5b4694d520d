"""+logger=tensorboard/mlflow/wandb through the command line, read back with each tracker's own
reader: the same steps and values as metrics.jsonl, the config as hyperparameters, a resumed run
continuing one tracker run without duplicates, a sweep's jobs grouped, a missing package refused."""
import json
import shutil
import struct
from pathlib import Path

import pytest

from conftest import TRACKED_SWEEP, run_cli

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

ALL = "+logger=[tensorboard,mlflow,wandb]"
TINY = ["data=random", "batch_size=2", "model.n_layer=1", "log_every=1", "eval_samples=4", "sample_tokens=0"]
EXACT = ("loss", "lr", "grad_norm", "eval_loss", "epoch")  # what an exact resume reproduces bit for bit


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def by_key(metrics: list[dict]) -> dict[str, dict[int, float]]:
    """{key: {step: value}} from metrics.jsonl rows (numbers only)."""
    out: dict[str, dict[int, float]] = {}
    for row in metrics:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):  # trackers take numbers
                out.setdefault(key, {})[row["step"]] = value
    return out


# ---- each tracker's own reader ----

def tensorboard_scalars(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], object]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()  # purge_orphaned_data (the default): a resumed writer's purge_step drops stale steps
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, acc


def tensorboard_hparams(acc) -> dict:
    from tensorboard.plugins.hparams import plugin_data_pb2
    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
                    for k, v in data.session_start_info.hparams.items()}
    return {}


def mlflow_client(store: Path):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")


def mlflow_history(client, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def wandb_records(run_dir: Path) -> list:
    """Every record of the run's offline transaction logs (``run-ID.wandb``; a resumed run adds a
    second offline-run folder with the same id). The file is a LevelDB-style log: a 7-byte
    ``:W&B`` header, then 32 KiB blocks of records (crc32, length, type; a record may span
    blocks: first/middle/last), each a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb
    out = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, block, parts = path.read_bytes(), 7, 32768, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            room = block - pos % block
            if room < 7:  # a block's tail too short for a header is padding
                pos += room
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:  # zero padding to the end of the block
                pos += room
                continue
            parts += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last piece of one
                out.append(pb.Record.FromString(parts))
                parts = b""
    return out


def wandb_history(records) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    out.setdefault(key, []).append((items["_step"], value))
    return out


def wandb_runs(records) -> list:
    return [r.run for r in records if r.WhichOneof("record_type") == "run"]


# ---- a run, killed after its last rows were sent but before its last checkpoint, resumed ----

@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """6 steps (checkpoints at 3 and 6), the step-6 checkpoint removed as if the run had died
    after logging step 6, then ``resume=auto``: steps 4-6 run (and are logged) a second time."""
    root = tmp_path_factory.mktemp("loggers")
    run_dir = root / "run"
    args = [*TINY, "max_steps=6", "eval_every=3", "checkpoint.every_steps=3", ALL, f"hydra.run.dir={run_dir}"]
    r = run_cli(*args, cwd=root)
    assert r.returncode == 0, r.stderr
    first = {"ids": json.loads((run_dir / "trackers.json").read_text()), "rows": rows(run_dir)}
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    r = run_cli(*args, "resume=auto", cwd=root)
    assert r.returncode == 0, r.stderr
    assert "at step 3" in r.stdout
    return root, run_dir, first


def test_rows_reach_every_tracker_once_after_a_resume(resumed):
    root, run_dir, first = resumed
    metrics = rows(run_dir)
    assert [r["step"] for r in metrics if "loss" in r] == [1, 2, 3, 4, 5, 6]
    want = by_key(metrics)
    assert set(want) >= {"loss", "eval_loss", "tokens_per_s", "peak_mem_mb", "resumed_from"}

    tb, acc = tensorboard_scalars(run_dir)
    assert set(tb) == set(want)
    for key, values in want.items():  # steps past the checkpoint purged and written again: every value
        assert [s for s, _ in tb[key]] == sorted(values), key
        assert [v for _, v in tb[key]] == pytest.approx([values[s] for s in sorted(values)], rel=1e-6), key

    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids == first["ids"]  # the same tracker runs continued
    client = mlflow_client(root)  # the store sits in the run directory's parent
    assert [e.name for e in client.search_experiments() if e.name != "Default"] == ["looplib"]
    [run] = client.search_runs([client.get_experiment_by_name("looplib").experiment_id])
    assert run.info.run_id == ids["mlflow"] and run.info.status == "FINISHED"
    ml = mlflow_history(client, ids["mlflow"], want)
    wb = wandb_history(wandb_records(run_dir))
    assert {r.run_id for r in wandb_runs(wandb_records(run_dir))} == {ids["wandb"]}
    for got in (ml, wb):
        for key, values in want.items():  # one value per step: nothing logged twice
            assert [s for s, _ in got[key]] == sorted(values), key
        for key in EXACT:  # the resumed run recomputed these identically
            assert [v for _, v in got[key]] == pytest.approx([want[key][s] for s in sorted(want[key])], rel=1e-6)
    assert by_key(first["rows"])["loss"] == want["loss"]


def test_trackers_hold_the_config_and_the_artefacts(resumed):
    root, run_dir, _ = resumed
    config = (run_dir / "config.yaml").read_text()
    assert "lr: 0.002" in config and "max_steps: 6" in config

    _, acc = tensorboard_scalars(run_dir)
    hp = tensorboard_hparams(acc)
    assert hp["lr"] == pytest.approx(0.002) and hp["max_steps"] == 6 and hp["model._target_"] == "looplib.models.GPT"

    client = mlflow_client(root)
    run = client.get_run(json.loads((run_dir / "trackers.json").read_text())["mlflow"])
    assert run.data.params["lr"] == "0.002" and run.data.params["model.n_layer"] == "1"
    assert run.data.tags["looplib.run_dir"] == str(run_dir)
    assert run.data.tags["looplib.model"] == str(run_dir / "model.safetensors")
    assert run.data.tags["looplib.checkpoint"] == str(run_dir / "checkpoints" / "step-00000006")

    records = wandb_records(run_dir)
    config = {i.key: json.loads(i.value_json) for i in wandb_runs(records)[0].config.update}
    assert config["lr"] == {"value": 0.002} or config["lr"] == 0.002
    summary = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for i in r.summary.update if i.key}
    assert summary["model"] == str(run_dir / "model.safetensors") and summary["run_dir"] == str(run_dir)


def test_a_sweep_is_one_experiment_one_group_one_folder(tracked_sweep):
    sweep = tracked_sweep
    jobs = [sweep / "0", sweep / "1"]
    for job in jobs:  # TensorBoard: one folder per job under the sweep's folder
        tb, _ = tensorboard_scalars(job)
        want = by_key(rows(job))
        assert [s for s, _ in tb["loss"]] == sorted(want["loss"]) == [1, 2, 3, 4]
        assert [s for s, _ in tb["eval_loss"]] == sorted(want["eval_loss"]) == [2, 4]
    client = mlflow_client(sweep)  # one store in the sweep directory, one experiment for the sweep
    [experiment] = [e for e in client.search_experiments() if e.name != "Default"]
    assert experiment.name == str(sweep)
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(json.loads((j / "trackers.json").read_text())["mlflow"]
                                                         for j in jobs)
    assert sorted(r.info.run_name for r in runs) == [
        "0: +optim=adamw +logger=[tensorboard,mlflow,wandb] " + " ".join(TRACKED_SWEEP[3:]),
        "1: +optim=sgd +logger=[tensorboard,mlflow,wandb] " + " ".join(TRACKED_SWEEP[3:])]
    for run, job in zip(sorted(runs, key=lambda r: r.info.run_name), jobs):
        got, want = mlflow_history(client, run.info.run_id, ["loss"])["loss"], by_key(rows(job))["loss"]
        assert [s for s, _ in got] == sorted(want)
        assert [v for _, v in got] == pytest.approx([want[s] for s in sorted(want)], rel=1e-6)
    groups = {run.run_group for job in jobs for run in wandb_runs(wandb_records(job))}
    assert groups == {str(sweep)}


def test_a_missing_tracker_is_refused_in_one_line(tmp_path):
    hidden = tmp_path / "hidden"
    (hidden / "wandb").mkdir(parents=True)  # shadows the installed package: `import wandb` fails
    (hidden / "wandb" / "__init__.py").write_text("raise ImportError('No module named wandb')\n")
    r = run_cli(*TINY, "max_steps=1", "+logger=[tensorboard,wandb]", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path,
                env={"PYTHONPATH": str(hidden)})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "looplib: error: logger.wandb: +logger=wandb needs the wandb package, which does not import "
        "(No module named wandb); "
        "pip install 'looplib[wandb]', or leave out +logger=wandb"]
    assert not (tmp_path / "run").exists()


def test_several_options_and_your_own_compose_side_by_side():
    from hydra import compose, initialize_config_module

    from looplib.cli.instantiate import build_loggers
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+logger=[tensorboard,mlflow]",
                                                       "+logger.mine._target_=looplib.loggers.Logger"])
    assert list(cfg.logger) == ["tensorboard", "mlflow", "mine"]
    assert [type(x).__name__ for x in build_loggers(cfg).loggers] == ["TensorBoard", "MLflow", "Logger"]

"""An MLflow run (``+logger=mlflow``)."""
from __future__ import annotations

import os

from .base import Run
from .tracker import Tracker, flatten, need_tracker


class MLflow(Tracker):
    """An MLflow run. Store: ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else a local SQLite
    store ``mlflow.db`` in the run directory's parent (a sweep's: its multirun directory; view it
    with ``mlflow ui --backend-store-uri sqlite:///<parent>/mlflow.db``). MLflow 3 refuses its
    old ``./mlruns`` file store unless ``MLFLOW_ALLOW_FILE_STORE=true``, hence SQLite, MLflow's
    own default now. Experiment: ``experiment``, else
    ``MLFLOW_EXPERIMENT_NAME``, else the sweep directory for a sweep's jobs and ``looplib``
    for single runs. Params: the resolved config, flattened (``optim.lr``); tags: the run
    directory and the artefact paths."""
    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None):
        self.tracking_uri, self.experiment = tracking_uri, experiment
        need_tracker("mlflow", "mlflow", "mlflow")
        self.client = self.run_id = None

    def start(self, run: Run) -> None:
        super().start(run)
        from mlflow.tracking import MlflowClient
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        local = None if uri else run.dir.parent.resolve()
        self.client = MlflowClient(tracking_uri=uri or f"sqlite:///{local / 'mlflow.db'}")
        self.run_id = self.stored_id()
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            known = self.client.get_run(self.run_id).data.params
        else:
            name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or run.group or "looplib"
            found = self.client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found else self.client.create_experiment(
                name, artifact_location=(local / "mlartifacts").as_uri() if local else None)
            self.run_id = self.client.create_run(experiment_id, run_name=run.name[:250],
                                                 tags={"looplib.run_dir": str(run.dir)}).info.run_id
            self.store_id(self.run_id)
            known = {}
        from mlflow.entities import Param
        params = {k: str(v)[:6000] for k, v in flatten(run.config).items()}
        changed = {f"looplib.resume_changed.{k}": v for k, v in params.items() if k in known and known[k] != v}
        params = [Param(k, v) for k, v in params.items() if k not in known]  # params cannot change
        for i in range(0, len(params), 100):  # the store takes at most 100 per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        for key, value in changed.items():
            self.client.set_tag(self.run_id, key, value)
        self.catch_up()

    def log(self, row: dict) -> None:
        import time

        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, row["step"]) for k, v in self.fresh(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, status: str, artefacts: dict[str, str]) -> None:
        if self.client is None:
            return
        for name, path in artefacts.items():
            self.client.set_tag(self.run_id, f"looplib.{name}", path)
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "preempted": "KILLED"}.get(status, "FAILED"))

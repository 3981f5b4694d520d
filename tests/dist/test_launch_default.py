"""Launchers (issue 21): several processes and no engine chosen train one run with DDP (said in a
log line), not N copies of the job; two torchrun agents as two "nodes" train the same run as one
node with two processes; an engine that runs in one process is refused by every rank."""
import json
import os
import subprocess
import sys

import pytest

from conftest import run_cli
import warm_ranks
from looplib.process.launcher import free_port

JOB = ["data=random", "data.n_train=64", "data.n_eval=8", "max_steps=3", "log_every=1", "eval_every=0",
       "eval_samples=4", "sample_tokens=0", "checkpoint.enabled=false", "batch_size=4", "model.n_layer=1",
       "model.d_model=32", "model.n_head=2", "model.seq_len=16", "progress=lines"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def torchrun(*args: str) -> list[str]:
    return warm_ranks.command([sys.executable, "-m", "torch.distributed.run", *args, "-m", "looplib.train", *JOB])


def losses(cwd) -> list[float]:
    runs = list((cwd / "outputs").glob("*/*"))
    assert len(runs) == 1, runs  # one run, one directory
    rows = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert "_target_: looplib.engines.DDP" in (runs[0] / "config.yaml").read_text()
    return [m["loss"] for m in rows if "loss" in m]


def test_torchrun_without_an_engine_trains_ddp_and_two_nodes_match_one(tmp_path):
    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    one.mkdir(), two.mkdir()
    r = subprocess.run(torchrun("--nproc_per_node", "2", "--master_port", str(free_port())), cwd=one, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    said = [line for line in (r.stdout + r.stderr).splitlines() if "no engine was chosen" in line]
    assert len(said) == 1 and "torchrun started 2 processes" in said[0] and "+engine=ddp" in said[0], said
    assert (r.stdout + r.stderr).count("step 3/3") == 1  # one voice, not every line twice
    assert " x 1 sequences x 2 processes, precision" in r.stdout  # the header's batch is per process
    reference = losses(one)
    assert len(reference) == 3

    # the documented multi-node line: each node runs the same command (one process per node here)
    port = free_port()
    agents = [subprocess.Popen(torchrun("--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                                        "--rdzv-endpoint", f"127.0.0.1:{port}"),
                               cwd=two, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    assert losses(two) == pytest.approx(reference, rel=1e-6)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_an_engine_of_one_process_is_refused_by_every_rank(monkeypatch, rank):
    from omegaconf import OmegaConf

    from looplib.cli.instantiate import refuse_one_process_engine
    from looplib.errors import ConfigError
    for key, value in {"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank, "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:  # build.check_config calls it before anything is built
        refuse_one_process_engine(OmegaConf.create({"engine": {"_target_": "looplib.engines.Local"}}))
    assert str(err.value).startswith("engine: Local runs in one process, but torchrun started 2") and \
        "+engine=ddp" in str(err.value)
    for engine in ("DDP", "fsdp.FSDP"):  # those run as one rank of several
        refuse_one_process_engine(OmegaConf.create({"engine": {"_target_": f"looplib.engines.{engine}"}}))


def test_a_rank_killed_outright_is_one_line_naming_it_no_traceback(tmp_path):
    """SIGKILL to rank 1 mid-run: rank 0 says which rank was lost in one line and exits 1 (not a
    gloo traceback through looplib's code, nor 'Exception ignored in atexit' when torchrun's
    SIGTERM follows)."""
    import signal
    from pathlib import Path
    status = tmp_path / "status"
    args = torchrun("--nproc_per_node", "2", "--master_port", str(free_port()))
    args = [a for a in args if a not in ("max_steps=3", "checkpoint.enabled=false")] + ["max_steps=100000"]
    proc = subprocess.Popen([*args, "+engine=ddp", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                            env={**ENV, "LOOPLIB_EXIT_FILE": str(status)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "step 2/" in line:
            break
    workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    [rank1] = [int(pid) for pid in workers if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()]
    os.kill(rank1, signal.SIGKILL)
    out = "".join(seen) + proc.communicate(timeout=300)[0]
    said = [line for line in out.splitlines() if line.startswith("looplib:")]
    assert len(said) == 1 and said[0].startswith("looplib: stopped: rank 1 of 2 was lost"), out
    assert "[rank0]" not in out and "Exception ignored" not in out and "by peer" not in out, out
    assert status.read_text().strip() == "1"  # rank 0's own status (torchrun itself reports 1 too)


LAUNCHERS = [  # the environment each launcher gives a process, and the name the log line uses
    ({"WORLD_SIZE": "2", "RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
    ({"WORLD_SIZE": "2", "RANK": "0", "CROSS_RANK": "0", "LOCAL_SIZE": "2"}, "the deepspeed launcher"),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, "SLURM"),
]


@pytest.mark.parametrize("env,who", LAUNCHERS, ids=[w for _, w in LAUNCHERS])
def test_each_launcher_without_an_engine_gets_ddp(monkeypatch, caplog, env, who):
    from omegaconf import OmegaConf

    from looplib.cli import instantiate
    from looplib.run import launcher
    monkeypatch.setattr(launcher, "SAID", [])  # said once a process: this test's process may have said it
    for key in ("WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID", "CROSS_RANK", "LOCAL_SIZE", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    assert instantiate.launcher_defaults(OmegaConf.create({})) == {}  # one process: the local engine stays
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level("INFO", logger="looplib"):
        assert instantiate.launcher_defaults(OmegaConf.create({})) == {"engine": "ddp"}
    assert f"{who} started {env.get('WORLD_SIZE', env.get('SLURM_NTASKS'))} processes" in caplog.text
    chosen = OmegaConf.create({"engine": {"_target_": "looplib.engines.FSDP"}})
    assert instantiate.launcher_defaults(chosen) == {}  # an engine chosen: kept


def test_a_multi_process_engine_without_a_launcher_says_it_trains_alone(tmp_path):
    """`+engine=ddp` typed as a plain command trained as one process without a word; now one
    warning names the engine and the launcher to use (the run itself is still one exact process)."""
    r = run_cli("+engine=ddp", *JOB, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "DDP was started without a launcher, so it trains as one process" in out and "torchrun --nproc_per_node N" in out
    r = run_cli(*JOB, f"hydra.run.dir={tmp_path / 'plain'}", cwd=tmp_path)
    assert "without a launcher" not in r.stdout + r.stderr  # the local engine needs none

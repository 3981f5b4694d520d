"""The printed best command names its launcher and process counts (the tests under torchrun: tests/dist/test_sweep_torchrun.py)."""
import pytest


@pytest.mark.parametrize("env,start", [
    ({}, "python -m looplib.train"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"},
     "torchrun --nproc_per_node 2 -m looplib.train"),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
     "torchrun --nnodes 2 --nproc_per_node 8 -m looplib.train"),
    ({"WORLD_SIZE": "4", "LOCAL_SIZE": "4", "CROSS_RANK": "0", "CROSS_SIZE": "1"},
     "deepspeed --num_gpus 4 --module looplib.train"),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, "srun --ntasks 4 python -m looplib.train"),
    ({"WORLD_SIZE": "3"}, "torchrun --nproc_per_node 3 -m looplib.train"),  # a launcher that says only WORLD_SIZE
])
def test_a_printed_command_starts_with_the_launcher_and_its_process_counts(monkeypatch, env, start):
    from looplib.process.launcher import launcher, relaunch
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "LOCAL_SIZE", "CROSS_RANK",
                "CROSS_SIZE", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert relaunch("looplib.train") == start
    assert launcher() == start.removesuffix(" -m looplib.train").removesuffix(" --module looplib.train")

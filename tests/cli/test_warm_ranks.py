"""The tests' warm torchrun workers (tests/warm_ranks.py, tests/warm_rank_shim.py) end as a fresh
worker would, as torchrun sees them: the rank's exit status, a signal that killed it, a signal
torchrun sends passed on, and a rank that does not outlive its shim."""
import os
import signal
import subprocess
import sys
import time

import pytest

import warm_ranks

RANK = """import os, signal, sys, time
print(os.getpid(), os.getppid(), sys.argv[1:], flush=True)
if sys.argv[1] == "exit":
    sys.exit(7)
if sys.argv[1] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def shim(tmp_path, how: str) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return subprocess.Popen([sys.executable, "-I", "-S", warm_ranks.SHIM, warm_ranks.address(), str(script), how],
                            stdout=subprocess.PIPE, text=True)


def gone(pid: int) -> bool:
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how, status", [("exit", 7), ("killed", -signal.SIGKILL)])
def test_a_warm_rank_ends_its_shim_as_it_ended(tmp_path, how, status):
    proc = shim(tmp_path, how)
    pid, parent, args = proc.stdout.readline().split(" ", 2)
    assert proc.wait(60) == status
    assert int(parent) == os.getpid() and int(pid) != proc.pid  # torchrun's view: the launcher is its parent
    assert args.strip() == f"['{how}']"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signal_to_the_shim_ends_the_rank_as_it_would_end_a_fresh_one(tmp_path, sig):
    """SIGTERM and SIGINT are passed on (a fresh python dies of SIGTERM, and of an uncaught
    KeyboardInterrupt by SIGINT); SIGKILL to the shim takes the rank with it."""
    proc = shim(tmp_path, "sleep")
    pid = int(proc.stdout.readline().split()[0])
    proc.send_signal(sig)
    assert proc.wait(60) == -sig
    assert gone(pid)

"""torchrun's workers for the tests, started warm: each rank a fork of the interpreter of tests/warm.py
(torch, looplib and Hydra imported) instead of a fresh ``python`` (about seven seconds of imports
each on a small machine).

``command(argv)`` rewrites a ``python -m torch.distributed.run ... -m MODULE ARGS`` (or ``... SCRIPT
ARGS``) command line to ``... --no-python PYTHON -I -S tests/warm_rank_shim.py ADDRESS -m MODULE ARGS``:
torchrun starts, signals and waits for the shim as it would for the rank, and the shim has this
process's warm rank server (``serve``: a fork of the warm interpreter, started once) fork the rank
with the shim's argv, environment, working directory and standard streams. The rank sees what a
rank of torchrun sees: its launcher (``os.getppid()``) is torchrun's agent, the shim's parent, and
it is in a session of its own. ``LOOPLIB_TEST_FRESH=1`` leaves the command as it is.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import uuid
from pathlib import Path

import warm

SHIM = str(Path(__file__).resolve().parent / "warm_rank_shim.py")
_address = None


def address() -> str:
    """The warm rank server's (abstract) socket name; the server is started on the first call."""
    global _address
    if _address is None:
        name = f"looplib-warm-ranks-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        ctx = warm.context()
        listening = ctx.Event()
        server = ctx.Process(target=serve, args=(name, warm.fresh_path(), listening), name="looplib-warm-ranks")
        server.start()
        atexit.register(stop, server)  # before multiprocessing's own exit handler, which would wait for it
        if not listening.wait(120):
            raise RuntimeError("the warm rank server did not start")
        _address = name
    return _address


def stop(server) -> None:
    server.kill()  # not SIGTERM: a test process that ran train_model in-process may ignore it, and so would its forks
    server.join(10)


def warm_on() -> bool:
    return os.environ.get("LOOPLIB_TEST_FRESH", "0") == "0"


def torchrun_args(args: list[str]) -> list[str]:
    """torchrun's own arguments (what follows ``-m torch.distributed.run``), rewritten so that its
    workers are warm ranks; as they are under ``LOOPLIB_TEST_FRESH=1`` or ``--no-python``."""
    from torch.distributed.run import get_args_parser
    args = [str(a) for a in args]
    if not warm_on():
        return args
    try:
        parsed = get_args_parser().parse_args(args)
    except SystemExit:  # not a command torchrun takes: as it is, for torchrun to refuse
        return args
    if parsed.no_python:
        return args
    at = len(args) - len(parsed.training_script_args) - 1
    assert args[at] == parsed.training_script, args
    options = [a for a in args[:at] if a not in ("-m", "--module")]
    target = ["-m", parsed.training_script] if parsed.module else [parsed.training_script]
    return [*options, "--no-python", sys.executable, "-I", "-S", SHIM, address(), *target,
            *parsed.training_script_args]


def command(argv: list) -> list:
    """A whole ``[python, -m, torch.distributed.run, ...]`` command line, its workers warm ranks."""
    argv = [str(a) for a in argv]
    at = argv.index("torch.distributed.run") + 1
    return [*argv[:at], *torchrun_args(argv[at:])]


# ---------------------------------------------------------------- the server, in a fork of the warm interpreter

def serve(name: str, base_path: list[str], listening) -> None:
    """Forks a rank for each shim that connects, and tells the shim its pid, then its exit status
    (multiprocessing's: -N when killed by signal N). Ends when the test process is gone."""
    import multiprocessing
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # what the test process ignored (inherited) is not ours
        signal.signal(sig, signal.SIG_DFL)
    fork = multiprocessing.get_context("fork")
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(128)
    listening.set()
    running: dict[int, tuple] = {}  # sentinel -> (process, connection to its shim)
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *running], [], [], 1.0)
        for r in ready:
            if r is listener:
                conn, _ = listener.accept()
                try:
                    proc = start_rank(fork, conn, base_path)
                except (OSError, ValueError, json.JSONDecodeError):
                    conn.close()
                    continue
                running[proc.sentinel] = (proc, conn)
            else:
                proc, conn = running.pop(r)
                proc.join()
                try:
                    conn.sendall(struct.pack("!i", proc.exitcode))
                except OSError:
                    pass  # its shim is gone
                conn.close()
                proc.close()


def start_rank(fork, conn: socket.socket, base_path: list[str]):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
    try:
        if len(fds) != 4 or len(data) < 4:
            raise ValueError("not a shim's request")
        size = struct.unpack("!I", data[:4])[0]
        data = data[4:]
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise ValueError("the shim went away")
            data += chunk
        request = json.loads(data)
        shim = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        proc = fork.Process(target=rank, args=(request, fds, shim, base_path), name="looplib-warm-rank")
        proc.start()
    finally:
        for fd in fds:
            os.close(fd)
    conn.sendall(struct.pack("!i", proc.pid))
    return proc


def rank(request: dict, fds: list[int], shim: int, base_path: list[str]) -> None:
    """In the forked rank: the shim's streams and lifeline, torchrun's view of the process, then
    what ``python -u -m MODULE ARGS`` runs."""
    import io
    os.setsid()  # torchrun starts each worker in a session of its own
    for fd, src in zip((0, 1, 2), fds):
        os.dup2(src, fd)
    lifeline = os.dup(fds[3])
    for src in fds:
        os.close(src)
    threading.Thread(target=die_with_shim, args=(lifeline,), name="looplib-warm-rank-lifeline", daemon=True).start()
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    for fd, stream in ((1, "stdout"), (2, "stderr")):  # python -u, as torchrun starts its workers
        setattr(sys, stream, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                              errors="backslashreplace" if fd == 2 else None))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr

    me, getppid = os.getpid(), os.getppid

    def launcher() -> int:
        """A worker's parent is torchrun's agent: here, the shim's parent (1 once the shim is gone);
        in a process this rank forks (a data loader's worker), its real parent."""
        if os.getpid() != me:
            return getppid()
        try:
            return int(Path(f"/proc/{shim}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return 1

    os.getppid = launcher
    if "looplib.run.signals" in sys.modules:  # read at import, which the warm interpreter did before the fork
        sys.modules["looplib.run.signals"].PARENT = launcher()
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = request["argv"]
    script = argv[0] != "-m"
    target, args = (argv[0], argv[1:]) if script else (argv[1], argv[2:])
    warm.run_as_main(target, args, request["cwd"], request["env"], base_path, script=script)


def die_with_shim(lifeline: int) -> None:
    while True:
        try:
            if not os.read(lifeline, 1):
                break
        except InterruptedError:
            continue
    os.kill(os.getpid(), signal.SIGKILL)

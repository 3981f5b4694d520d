"""``python -m MODULE ARGS`` for the tests, from an interpreter that has already imported torch,
torch._dynamo (every torch optimizer imports it on first use) and looplib: a fork of it runs the
module as ``__main__`` exactly as ``python -m`` would (argv, cwd, environment, warnings, thread
count, exit status, stdout and stderr), in about a second instead of seven. The interpreter is
multiprocessing's fork server, started once per test process with nothing but imports done.

Tests of the installation itself (entry points, a fresh virtual environment, what is imported
when) start a real interpreter (``run_cli(..., fresh=True)``); ``LOOPLIB_TEST_FRESH=1`` makes
every command do so.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile

PRELOAD = ["torch", "torch._dynamo", "looplib", "looplib.cli.main", "looplib.cli.entry", "looplib.run.session", "hydra",
           "omegaconf", "safetensors.torch", "numpy"]

_context = None
_base_path = None


def fresh_path() -> list[str]:
    """A fresh interpreter's sys.path, less its first entry (the script's or working directory)."""
    global _base_path
    if _base_path is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        code = "import json, sys; print(json.dumps(sys.path[1:]))"
        import json
        _base_path = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                               text=True, check=True).stdout)
    return _base_path


def context():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def main(module: str, args: list[str], cwd: str, env: dict, out: str, err: str, base_path: list[str]) -> None:
    """In the forked interpreter: what ``python -m module args`` does after start-up."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    run_as_main(module, args, cwd, env, base_path)


def run_as_main(module: str, args: list[str], cwd: str, env: dict, base_path: list[str], script: bool = False):
    """What ``python -m module args`` (``script``: ``python module args``, a path) does after
    start-up, in a fork of the warm interpreter whose standard streams are in place; never returns."""
    import runpy
    import warnings

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for option in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(option)  # what -W / PYTHONWARNINGS do at start-up
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    if env.get("OMP_NUM_THREADS"):
        import torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if "TORCHDYNAMO_DISABLE" in env:  # torch reads it once, at import, which this interpreter did before the fork
        import torch._dynamo
        torch._dynamo.config.disable = env["TORCHDYNAMO_DISABLE"] in ("1", "true", "True")
    sys.argv = [module, *args]
    # python -m's path: the working directory (a script's: its folder), PYTHONPATH, then the interpreter's own
    first = os.path.dirname(os.path.realpath(os.path.join(cwd, module))) if script else cwd
    sys.path[:] = [first, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)), *base_path]
    code = 0
    try:
        if script:
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter reads it: None 0, a number itself, anything else printed, 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # the interpreter prints it and, once shut down, ends killed by SIGINT
        sys.excepthook(*sys.exc_info())
        code = None
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # then what the interpreter does on its way out, which a multiprocessing child skips: join the
    # non-daemon threads and run the atexit callbacks (a joblib launcher's worker pool is shut down there;
    # multiprocessing would otherwise wait out the pool's five-minute idle timeout)
    import atexit
    import threading
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code is None:
        import signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


class Started:
    """A command running in a fork of the warm interpreter (``start``); ``wait`` gives its result."""

    def __init__(self, module: str, args: list[str], cwd, env: dict):
        self.tmp = tempfile.TemporaryDirectory(prefix="looplib-warm-")
        self.out, self.err = os.path.join(self.tmp.name, "out"), os.path.join(self.tmp.name, "err")
        for path in (self.out, self.err):
            open(path, "w").close()
        self.argv = [sys.executable, "-m", module, *args]
        self.proc = context().Process(target=main, args=(module, list(args), str(cwd), dict(env), self.out, self.err,
                                                         fresh_path()))
        self.proc.start()

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            self.proc.join(timeout)
            if self.proc.exitcode is None:
                self.proc.kill()
                self.proc.join()
                raise subprocess.TimeoutExpired(self.argv, timeout)
            with open(self.out, errors="replace") as f_out, open(self.err, errors="replace") as f_err:
                return subprocess.CompletedProcess(self.argv, self.proc.exitcode, f_out.read(), f_err.read())
        finally:
            self.tmp.cleanup()


def start(module: str, args: list[str], cwd, env: dict) -> Started:
    """``python -m module args`` started in a fork of the warm interpreter, not waited for."""
    return Started(module, args, cwd, env)


def run(module: str, args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return start(module, args, cwd, env).wait(timeout)

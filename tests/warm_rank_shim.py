"""A torchrun worker that costs milliseconds (tests/warm_ranks.py): ``python -I -S warm_rank_shim.py
ADDRESS -m MODULE ARGS`` (or ``ADDRESS SCRIPT ARGS``) asks the warm rank server at ADDRESS to fork
the rank: what ``python -u -m MODULE ARGS`` would run, with this process's environment, working
directory, stdin, stdout and stderr. It then stands in for the rank towards torchrun: SIGTERM,
SIGINT, SIGUSR1 and SIGHUP go on to the rank, and it ends as the rank ended (the same exit status,
or killed by the same signal). Killed itself (SIGKILL), it takes the rank with it: the rank watches
a pipe whose only write end is here. Standard library only, no site: it starts in milliseconds.
"""
import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)


def main() -> None:
    address, argv = sys.argv[1], sys.argv[2:]
    alive_r, alive_w = os.pipe()  # the rank's lifeline: EOF when this process is gone
    os.set_inheritable(alive_w, False)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + address)
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(sock, [struct.pack("!I", len(request)) + request], [0, 1, 2, alive_r])
    os.close(alive_r)
    pid = struct.unpack("!i", recv_exactly(sock, 4))[0]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status = struct.unpack("!i", recv_exactly(sock, 4))[0]  # as multiprocessing gives it: -N killed by signal N
    if status < 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        if -status not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        os._exit(128 - status)  # a signal that does not end a process by default (not one a rank dies of)
    os._exit(status)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except InterruptedError:
            continue
        if not chunk:
            sys.stderr.write("warm rank shim: the warm rank server went away\n")
            os._exit(1)
        data += chunk
    return data


if __name__ == "__main__":
    main()

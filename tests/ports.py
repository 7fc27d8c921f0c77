"""Launchers that must meet at a named port (two `accelerate-c launch` runs as two machines).

A port found free here can be taken by another test's processes (pytest-xdist runs two) before
machine 0's launcher binds it; then machine 0 fails at once, the other machines are stopped (they
would wait for a store that is not theirs) and all start again at a new port, once. Where one
launcher is enough, `--main_process_port 0` (torchrun binds the port itself) needs none of this.
"""
import os
import signal
import socket
import subprocess
import tempfile

# what torchrun's store says when its port was taken
PORT_TAKEN = ("Address already in use", "EADDRINUSE", "The server socket has failed to listen")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(text: str) -> bool:
    return any(m in text for m in PORT_TAKEN)


def _stop(p: subprocess.Popen) -> None:
    """The launcher and what it started. torchrun starts each rank in a session of its own, so
    the group gets SIGTERM first (torchrun's agent then stops its ranks, which hold the output
    open), and SIGKILL only if it is still there 15 s later."""
    if p.poll() is None:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    p.wait()


def _run_machines(commands: list, env: dict, timeout: float):
    # each machine writes to a file of its own, not a pipe: a machine whose pipe filled while
    # machine 0 was waited for would stall, and machine 0 with it
    files = [tempfile.TemporaryFile(mode="w+") for _ in commands]
    procs = [subprocess.Popen(c, stdout=f, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
             for c, f in zip(commands, files)]
    try:
        for i, p in enumerate(procs):
            if i and procs[0].returncode != 0:  # machine 0 failed: the others wait for nothing
                _stop(p)
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            _stop(p)
    outs = []
    for f in files:
        with f:
            f.seek(0)
            outs.append(f.read())
    return procs, outs


def run_machines(commands_at, env: dict, timeout: float):
    """commands_at(port) -> one command per machine; their processes and outputs, at a second
    port when the first was taken."""
    procs, outs = _run_machines(commands_at(str(free_port())), env, timeout)
    if any(p.returncode != 0 for p in procs) and port_taken("".join(outs)):
        procs, outs = _run_machines(commands_at(str(free_port())), env, timeout)
    return procs, outs

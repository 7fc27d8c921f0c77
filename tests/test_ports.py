"""tests/ports.run_machines: two launchers as two machines start again at a new port when the
first port was taken, and nothing they started outlives a failed attempt."""
import os
import shutil
import socket
import sys

import ports
from timeouts import wait_s

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "multinode_check.py")


def test_two_machines_meet_at_a_second_port_when_the_first_was_taken(tmp_path, monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = held.getsockname()[1]
    drawn = [busy]
    real = ports.free_port
    monkeypatch.setattr(ports, "free_port", lambda: drawn.pop() if drawn else real())
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    ports_used = []

    def commands(port):
        ports_used.append(port)
        common = ["--cpu", "--num_processes", "4", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
                  "--main_process_port", port, "--same_network"]
        return [[exe, "launch", *common, "--machine_rank", str(m), SCRIPT] for m in (0, 1)]

    try:
        procs, outs = ports.run_machines(commands, env, wait_s(90))
    finally:
        held.close()
    assert ports_used[0] == str(busy) and len(ports_used) == 2 and ports_used[1] != str(busy)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    text = "".join(outs)
    assert all(f"multinode OK rank {r} node" in text for r in range(4)), text

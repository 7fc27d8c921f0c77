"""Two `accelerate-c launch` runs as two "machines" on this host (loopback), 2 processes each: 4 ranks.

One run takes its multi-node settings from flags (static rendezvous through master_addr/port), the
other from one config file per machine (c10d rendezvous), as a real two-node job would.
"""
import os
import shutil
import sys
from ports import run_machines
from timeouts import wait_s

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "multinode_check.py")


def launch_two(tmp_path, args_for_port):
    """The two launchers, args_for_port(port) giving each one's arguments (ports.run_machines)."""
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    procs, outs = run_machines(lambda port: [[exe, "launch", *a, SCRIPT] for a in args_for_port(port)], env,
                               wait_s(90))
    for p, out in zip(procs, outs):
        assert p.returncode == 0, "\n".join(o[-3000:] for o in outs)
    text = "".join(outs)
    for rank in range(4):
        assert f"multinode OK rank {rank} node" in text, text
    return text


def test_two_machines_from_flags_static_rendezvous(tmp_path):
    def args(port):
        common = ["--cpu", "--num_processes", "4", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
                  "--main_process_port", port, "--same_network"]
        return [common + ["--machine_rank", "0"], common + ["--machine_rank", "1"]]

    text = launch_two(tmp_path, args)
    # static rendezvous keeps the machine ranks as given: ranks 0,1 on machine 0, ranks 2,3 on machine 1
    for rank in range(4):
        assert f"multinode OK rank {rank} node {rank // 2}" in text, text


def test_two_machines_from_config_files_c10d(tmp_path):
    def args(port):
        out = []
        for rank in (0, 1):
            cfg = tmp_path / f"machine{rank}.yaml"
            cfg.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nuse_cpu: true\n"
                           f"num_processes: 4\nnum_machines: 2\nmachine_rank: {rank}\n"
                           f"main_process_ip: 127.0.0.1\nmain_process_port: {port}\nrdzv_backend: c10d\n"
                           f"same_network: false\nmixed_precision: no\n")
            out.append(["--config_file", str(cfg)])
        return out

    launch_two(tmp_path, args)

"""`accelerate-c launch`: real processes through the real launcher (torchrun underneath, gloo)."""
import os
import shutil
import subprocess
import sys

import pytest
from ports import port_taken
from timeouts import wait_s

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")


def launcher():
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    assert exe, "accelerate-c console script not installed"
    return exe


def launch(args, env=None, timeout=wait_s(180)):
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("WORLD_SIZE", None)
    res = subprocess.run([launcher(), "launch", *args], capture_output=True, text=True, timeout=timeout,
                         env=full_env)
    # a fixed port (--main_process_port N, or none: 29500) can be another test's (ports.py); once more
    if res.returncode != 0 and port_taken(res.stdout + res.stderr):
        res = subprocess.run([launcher(), "launch", *args], capture_output=True, text=True, timeout=timeout,
                             env=full_env)
    return res


@pytest.mark.parametrize("n", [2, 3])
def test_distributed_ops_on_n_processes(n):
    res = launch(["--num_processes", str(n), "--cpu", "--main_process_port", "0", "--mixed_precision", "bf16",
                  os.path.join(SCRIPTS, "distributed_ops.py")], env={"EXPECT_MIXED_PRECISION": "bf16"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"distributed ops OK on {n} processes" in res.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_data_sharding_on_n_processes(n):
    res = launch(["--num_processes", str(n), "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "data_sharding.py")])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"data sharding OK on {n} processes" in res.stdout


def test_single_process_launch_passes_settings(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import sys\nfrom accelerate_c import Accelerator\n"
                      "a = Accelerator()\n"
                      "print(a.mixed_precision, a.gradient_accumulation_steps, a.device, sys.argv[1:])\n")
    res = launch(["--cpu", "--mixed_precision", "fp16", "--gradient_accumulation_steps", "3", str(script),
                  "--flag", "x"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["fp16", "3", "cpu", "['--flag',", "'x']"]


def test_module_launch(tmp_path):
    (tmp_path / "mymod.py").write_text("print('module ran')\n")
    res = launch(["-m", "mymod"], env={"PYTHONPATH": str(tmp_path)})
    assert res.returncode == 0 and "module ran" in res.stdout, res.stderr


def test_a_dying_rank_stops_the_job_with_an_error():
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "fail_rank.py")], timeout=wait_s(120))
    assert res.returncode != 0


@pytest.mark.parametrize("args,msg", [
    (["--num_processes", "0", "x.py"], "--num_processes must be >= 1"),
    (["--mixed_precision", "fp32", "x.py"], "unknown --mixed_precision 'fp32'"),
    (["--gradient_accumulation_steps", "0", "x.py"], "--gradient_accumulation_steps must be >= 1"),
    (["-m", "--no_python", "x"], "--module and --no_python cannot be used together"),
])
def test_bad_launch_arguments(args, msg):
    res = launch(args)
    assert res.returncode != 0 and msg in res.stderr, res.stderr


def test_world_size_env_is_validated(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("from accelerate_c import Accelerator\nAccelerator()\n")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=wait_s(60),
                         env=dict(os.environ, WORLD_SIZE="two"))
    assert res.returncode != 0 and "WORLD_SIZE='two' is not an integer" in res.stderr


def test_script_arguments_are_never_taken_for_launcher_flags(tmp_path):
    """`--n 3` after the script is the script's, even though it is a prefix of launcher flags
    (argparse would otherwise match abbreviations and fail with "ambiguous option")."""
    script = tmp_path / "args.py"
    script.write_text("import sys\nprint('ARGS', sys.argv[1:])\n")
    res = launch(["--cpu", str(script), "--n", "3", "--num", "4", "-m", "x", "--cpu"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ARGS ['--n', '3', '--num', '4', '-m', 'x', '--cpu']" in res.stdout


def test_hyphenated_flags_work_as_in_accelerate(tmp_path):
    """accelerate launch takes --num-processes / --mixed-precision as well as the underscored
    spellings; so does ours."""
    script = tmp_path / "mp.py"
    script.write_text("import os\nprint('MP', os.environ.get('ACCELERATE_MIXED_PRECISION'))\n")
    res = launch(["--cpu", "--num-processes", "1", "--mixed-precision", "bf16", str(script)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "MP bf16" in res.stdout
    # the several-machines options too (they live in an argument group of their own)
    res = launch(["--cpu", "--num-processes", "1", "--num-machines", "1", "--machine-rank", "0",
                  "--main-process-port", "0", "--rdzv-backend", "static", str(script)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "MP" in res.stdout

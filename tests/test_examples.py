"""Every example of examples/ launched for a few steps on 2 processes through the real launcher
(tests/scripts/run_examples.py runs them one after the other in the same processes, to pay the
start-up once), and what each prints checked."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from timeouts import wait_s

HERE = os.path.dirname(os.path.abspath(__file__))


def _launch(*args, timeout=wait_s(180)):
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([exe, "launch", "--num_processes", "2", "--cpu", "--main_process_port", "0", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_every_example_runs_a_few_steps_on_two_processes(tmp_path):
    res = _launch(os.path.join(HERE, "scripts", "run_examples.py"), str(tmp_path))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    ranks = [json.load(open(tmp_path / f"examples_{r}.json")) for r in range(2)]
    assert ranks[0] == ranks[1]  # every metric is computed over the gathered whole, the same everywhere
    rows = [json.loads(x) for x in open(tmp_path / "tracking" / "tracking_example" / "metrics.jsonl")]
    assert [r["_step"] for r in rows] == [1, 2, 3, 3] and "eval_accuracy" in rows[-1]
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["step_2", "step_4"]
    # each example's first docstring line says what it shows and how to launch it
    examples = os.path.join(os.path.dirname(HERE), "examples")
    for folder in (examples, os.path.join(examples, "by_feature")):
        for name in os.listdir(folder):
            if name.endswith(".py") and name not in ("text_task.py", "tiny_corpus.py"):
                first = open(os.path.join(folder, name)).readline()
                assert first.startswith('"""') and "Launch: " in first or "make demo" in first, name

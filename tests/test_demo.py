"""make demo's script (examples/demo.py) at a tiny size: two launches of examples/train_gpt.py on
2 processes (the second resumed from the first's half-way checkpoint in new processes), the
resumed half bitwise the uninterrupted one, the files it names present, and a non-zero exit
when the held-out target is missed."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from timeouts import wait_s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--steps", "6", "--text-chars", "12000", "--d-model", "32", "--layers", "1", "--eval-every", "3",
        "--log-every", "3"]


def _demo(out, *extra):
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--out", str(out), *TINY,
                           *extra], capture_output=True, text=True, timeout=wait_s(150), env=env)


def test_demo_resumes_bitwise_and_leaves_its_files(tmp_path):
    res = _demo(tmp_path / "demo", "--target-loss", "10")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "bitwise the same as the uninterrupted run" in res.stdout
    out = tmp_path / "demo"
    for name in ("full/metrics.jsonl", "resumed/metrics.jsonl", "loss_curve.png", "checkpoint"):
        assert str(out / name) in res.stdout and (out / name).exists(), name
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(out / "resumed"))
    full = [json.loads(x) for x in open(out / "full" / "metrics.jsonl")]
    resumed = [json.loads(x) for x in open(out / "resumed" / "metrics.jsonl")]
    assert [r["_step"] for r in full] == [1, 2, 3, 4, 5, 6] and [r["_step"] for r in resumed] == [4, 5, 6]
    strip = [{k: v for k, v in r.items() if k != "_timestamp"} for r in full[3:]]
    assert strip == [{k: v for k, v in r.items() if k != "_timestamp"} for r in resumed]
    assert open(out / "loss_curve.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # what makes the demo fail: a logged value one ulp off in the resumed half, a missed target
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import demo

    assert demo.verify(str(out), 3, 10.0)[4:] == (True, True)
    assert demo.verify(str(out), 3, 1e-3)[5] is False
    resumed[1]["train_loss"] = math.nextafter(resumed[1]["train_loss"], math.inf)
    with open(out / "resumed" / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in resumed)
    assert demo.verify(str(out), 3, 10.0)[3:5] == ([5], False)

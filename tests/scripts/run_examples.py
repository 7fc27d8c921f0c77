"""Run on 2 processes by tests/test_examples.py: every example of examples/ for a few steps, one
after the other in the same processes (an import each, its main() called with tiny sizes), with
what each must show checked. Usage: run_examples.py SHARED_DIR"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "examples", "by_feature"))
shared = sys.argv[1]
TINY = ["--cpu", "--train_size", "64", "--eval_size", "41", "--batch_size", "8", "--num_epochs", "1",
        "--max_train_steps", "3"]
results = {}

import nlp_example  # noqa: E402

results["nlp_example"] = nlp_example.main(TINY)
assert results["nlp_example"]["count"] == 41, results  # every evaluation sample once, across processes

import gradient_accumulation  # noqa: E402

results["gradient_accumulation"] = gradient_accumulation.main(TINY + ["--gradient_accumulation_steps", "2"])

import checkpointing  # noqa: E402

ckpt = os.path.join(shared, "ckpts")
whole = checkpointing.main(TINY + ["--max_train_steps", "4", "--checkpointing_steps", "2", "--output_dir", ckpt])
resumed = checkpointing.main(TINY + ["--max_train_steps", "4", "--checkpointing_steps", "2", "--output_dir",
                                     os.path.join(shared, "ckpts_resumed"), "--resume_from_checkpoint",
                                     os.path.join(ckpt, "step_2")])
assert resumed == whole, (whole, resumed)  # steps 3-4 again from step 2's checkpoint: the same model
results["checkpointing"] = whole

import early_stopping  # noqa: E402

results["early_stopping"] = early_stopping.main(TINY + ["--stop_below", "100"])
assert results["early_stopping"]["stopped_early"] and results["early_stopping"]["step"] == 1, results

import multi_process_metrics  # noqa: E402

results["multi_process_metrics"] = multi_process_metrics.main(TINY)
assert results["multi_process_metrics"]["count"] == 41 < results["multi_process_metrics"]["count_with_gather"]

import zero2  # noqa: E402

results["zero2"] = zero2.main(TINY)

import tracking  # noqa: E402  (last: its end_training ends the process group)

results["tracking"] = tracking.main(TINY + ["--project_dir", os.path.join(shared, "tracking")])

rank = int(os.environ["RANK"])
with open(os.path.join(shared, f"examples_{rank}.json"), "w") as f:
    json.dump(results, f)
print(f"examples ran on rank {rank}")

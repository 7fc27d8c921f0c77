"""Run by tests/test_examples.py under the seed FSDP config (tests/data/fsdp_seed_config.yaml)
on 2 processes: examples/by_feature/fsdp.py, then examples/by_feature/trainer.py, each for a few
steps in the same processes (one start-up for both); each rank writes what they returned.
Usage: run_llama_examples.py SHARED_DIR"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "examples", "by_feature"))
shared = sys.argv[1]
SIZES = ["--cpu", "--train_size", "48", "--eval_size", "20", "--batch_size", "4"]
results = {}

import fsdp  # noqa: E402

results["fsdp"] = fsdp.main(SIZES + ["--max_train_steps", "3", "--output_dir", os.path.join(shared, "fsdp_model")])

import trainer  # noqa: E402

results["trainer"] = trainer.main(SIZES + ["--max_steps", "4", "--eval_steps", "2", "--save_steps", "2",
                                           "--output_dir", os.path.join(shared, "trainer")])

rank = int(os.environ["RANK"])
with open(os.path.join(shared, f"llama_examples_{rank}.json"), "w") as f:
    json.dump(results, f)
print(f"llama examples ran on rank {rank}")
import torch.distributed as dist  # noqa: E402

dist.destroy_process_group()  # the Trainer leaves it open, as transformers' does

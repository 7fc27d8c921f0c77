"""Run by tests/test_multinode.py on 2 launchers x 2 processes: checks the 4-rank world."""
import os

import torch
import torch.distributed as dist

from accelerate_c import Accelerator


acc = Accelerator()
state = acc.state
assert state.num_processes == 4, state.num_processes
assert int(os.environ["WORLD_SIZE"]) == 4
assert int(os.environ["LOCAL_WORLD_SIZE"]) == 2, os.environ["LOCAL_WORLD_SIZE"]
ranks = [None] * 4
dist.all_gather_object(ranks, (state.process_index, state.local_process_index, os.environ["GROUP_RANK"]))
assert sorted(r[0] for r in ranks) == [0, 1, 2, 3], ranks
assert sorted(r[1] for r in ranks) == [0, 0, 1, 1], ranks
assert len({r[2] for r in ranks}) == 2, ranks  # two machines
t = torch.tensor([float(state.process_index + 1)])
dist.all_reduce(t)
assert t.item() == 10.0, t
acc.wait_for_everyone()
print(f"multinode OK rank {state.process_index} node {os.environ['GROUP_RANK']}", flush=True)

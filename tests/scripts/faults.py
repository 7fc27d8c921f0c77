"""Run through the launcher with a mode argument:
- raise:   the last rank raises mid-step (before its backward); the others are blocked in the
           gradient all-reduce that backward starts; the job must end non-zero, not hang.
- timeout: InitProcessGroupKwargs(timeout=FAULT_TIMEOUT_S, 3 s on an idle machine: the ranks
           must also meet within it at start-up, so the test scales it to the machine's load);
           the last rank is late to the backward by more than that; rank 0's bucket all-reduce
           must raise, naming the rank and the bucket, instead of waiting forever."""
import datetime
import os
import sys
import time

import torch

from accelerate_c import Accelerator
from accelerate_c.utils import InitProcessGroupKwargs

mode = sys.argv[1]
TIMEOUT_S = float(os.environ.get("FAULT_TIMEOUT_S", "3"))
kwargs = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=TIMEOUT_S))] if mode == "timeout" else []
acc = Accelerator(cpu=True, kwargs_handlers=kwargs)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
last = acc.process_index == acc.num_processes - 1
loss = model(torch.randn(3, 4)).sum()
if mode == "raise" and last:
    raise RuntimeError("rank failure injected by the test")
if mode == "timeout":
    if last:
        time.sleep(TIMEOUT_S + max(5.0, TIMEOUT_S))
        sys.exit(0)
    try:
        acc.backward(loss)  # the buckets' all-reduce: the last rank never joins in time
    except RuntimeError as e:
        print(f"rank {acc.process_index} timed out as expected: {type(e).__name__}: {e}", flush=True)
        sys.exit(7)
    sys.exit(0)
acc.backward(loss)
opt.step()

"""A collective under full sharding called by one process only (launched by tests/test_fsdp.py on
2 processes, process-group timeout FSDP_TIMEOUT_S, 5 s on an idle machine, scaled by the test
to the machine's load: the ranks must also meet within it at start-up):
- `state_dict` (the default): rank 0 calls accelerator.get_state_dict(model) inside an `if
  is_main_process`, rank 1 does not. Rank 0 must get a RuntimeError naming the unit whose gather
  did not complete, within the timeout (not a hang); rank 1 waits, then both leave.
- `skip`: a forward whose path depends on the rank: rank 1 skips unit 'a', so the two processes'
  gathers no longer pair up. Each process must get a RuntimeError naming a unit within the
  timeout (not a hang, not a silently wrong result)."""
from __future__ import annotations

import datetime
import os
import sys
import time

import torch

from accelerate_c import Accelerator
from accelerate_c.fsdp_plugin import FullyShardedDataParallelPlugin
from accelerate_c.utils import InitProcessGroupKwargs


TIMEOUT_S = float(os.environ.get("FSDP_TIMEOUT_S", "5"))


class Net(torch.nn.Module):
    _no_split_modules = ["Linear"]

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x, skip=False):
        return self.b(x if skip else torch.tanh(self.a(x)))


acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
                                                                       auto_wrap_policy="TRANSFORMER_BASED_WRAP"),
                  kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=TIMEOUT_S))])
torch.manual_seed(0)
net = Net()
model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
acc.backward(model(torch.randn(4, 8)).sum())
opt.step()
opt.zero_grad()
acc.wait_for_everyone()
MODE = sys.argv[1] if len(sys.argv) > 1 else "state_dict"
if MODE == "skip":
    t0 = time.monotonic()
    try:
        acc.backward(model(torch.randn(4, 8), skip=acc.process_index == 1).sum())
        opt.step()
    except RuntimeError as e:
        took = time.monotonic() - t0
        assert "unit '" in str(e), str(e)
        assert took < 12 * TIMEOUT_S, took
        print(f"rank {acc.process_index}: a skipped unit refused after {took:.1f} s: {str(e)[:200]}", flush=True)
    else:
        raise AssertionError(f"rank {acc.process_index}: a forward that skips a unit on one process went through")
    os._exit(0)
if acc.is_main_process:
    t0 = time.monotonic()
    try:
        acc.get_state_dict(model)
    except RuntimeError as e:
        took = time.monotonic() - t0
        assert "unit 'a' (Linear)" in str(e), str(e)
        assert took < 12 * TIMEOUT_S, took
        print(f"one-rank get_state_dict refused after {took:.1f} s: {str(e)[:160]}", flush=True)
    else:
        raise AssertionError("get_state_dict on one process returned")
else:
    time.sleep(3 * TIMEOUT_S)
os._exit(0)  # the process group saw a failed collective: leave without tearing it down

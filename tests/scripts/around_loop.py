"""Run on 2 processes by tests/test_around_loop_processes.py: what happens around the training
loop, with accelerate_c's objects and accelerate 1.15's side by side in the same processes:
get_logger's main_process_only / in_order, accelerator.print, main_process_first,
local_main_process_first, the on_* decorators (of the Accelerator and of PartialState), profile()'s
traces, and trackers (main process only; get_tracker's blank tracker elsewhere).

Usage: around_loop.py SHARED_DIR (a directory every rank can write)."""
import contextlib
import io
import json
import logging
import os
import sys

import torch

import accelerate
import accelerate.tracking
from accelerate.logging import get_logger as their_get_logger

import accelerate_c
import accelerate_c.tracking
from accelerate_c.logging import get_logger as our_get_logger

shared = sys.argv[1]


def recorder(base):
    class Recorder(base):
        name = "recorder"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.calls = []

        @property
        def tracker(self):
            return self.calls

        def start(self):
            self.calls.append(["start"])

        def store_init_configuration(self, values):
            self.calls.append(["config", values])

        def log(self, values, step=None, **kwargs):
            self.calls.append(["log", values, step])

        def finish(self):
            self.calls.append(["finish"])

    return Recorder()


ours_rec, theirs_rec = recorder(accelerate_c.tracking.GeneralTracker), recorder(accelerate.tracking.GeneralTracker)
ours = accelerate_c.Accelerator(cpu=True, log_with=[ours_rec, "jsonl"], project_dir=os.path.join(shared, "ours"))
theirs = accelerate.Accelerator(cpu=True, log_with=[theirs_rec], project_dir=os.path.join(shared, "theirs"))
rank = ours.process_index
assert ours.num_processes == theirs.num_processes == 2 and theirs.process_index == rank
results = {}


def sync():
    ours.wait_for_everyone()


# ---- get_logger -------------------------------------------------------------------------------
def log_phase(who, make, phase, emit):
    logger = make(f"around_{who}_{phase}", log_level="INFO")
    handler = logging.FileHandler(os.path.join(shared, f"log_{who}_{phase}.txt"))  # append mode, flushed per record
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.logger.addHandler(handler)
    logger.logger.propagate = False
    emit(logger)
    handler.close()
    sync()


PHASES = {
    "main_only": lambda lg: (lg.info("main only %d", rank), lg.debug("below the level"), lg.warning("warned")),
    "everyone": lambda lg: lg.info("everyone %d", rank, main_process_only=False),
    "in_order": lambda lg: [lg.info("turn of %d (%d)", rank, i, in_order=True) for i in range(2)],
    "once": lambda lg: [lg.warning_once("said once") for _ in range(3)],
}
for phase, emit in PHASES.items():
    log_phase("ours", our_get_logger, phase, emit)
    log_phase("theirs", their_get_logger, phase, emit)

# ---- print ------------------------------------------------------------------------------------
for who, acc in (("ours", ours), ("theirs", theirs)):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        acc.print("printed by", rank)
    results[f"print_{who}"] = buf.getvalue()

# ---- main_process_first / local_main_process_first ----------------------------------------
for who, acc in (("ours", ours), ("theirs", theirs)):
    for kind in ("main_process_first", "local_main_process_first"):
        with getattr(acc, kind)():
            with open(os.path.join(shared, f"{kind}_{who}.txt"), "a") as f:
                f.write(f"{rank}\n")
        sync()

# ---- on_* decorators -------------------------------------------------------------------------
def decorated(holder):
    ran = []
    made = {
        "on_main_process": holder.on_main_process(lambda: ran.append("main") or "main"),
        "on_local_main_process": holder.on_local_main_process(lambda: ran.append("local_main") or "local_main"),
        "on_last_process": holder.on_last_process(lambda: ran.append("last") or "last"),
        "on_process(1)": holder.on_process(process_index=1)(lambda: ran.append("p1") or "p1"),
        "on_process(0, fn)": holder.on_process(lambda: ran.append("p0") or "p0", process_index=0),
        "on_local_process(1)": holder.on_local_process(local_process_index=1)(lambda: ran.append("l1") or "l1"),
    }
    returned = {name: fn() for name, fn in made.items()}
    return {"ran": ran, "returned": returned}


results["decorators_ours"] = decorated(ours)
results["decorators_theirs"] = decorated(theirs)
results["state_decorators_ours"] = decorated(accelerate_c.PartialState())
results["state_decorators_theirs"] = decorated(accelerate.PartialState())

# ---- profile(): a Chrome trace per process in one directory, complete when profile() returns
for who, acc, lib in (("ours", ours, accelerate_c), ("theirs", theirs, accelerate)):
    trace_dir = os.path.join(shared, f"trace_{who}")
    with acc.profile(lib.utils.ProfileKwargs(output_trace_dir=trace_dir)):
        torch.ones(4).mul(rank + 1)
    results[f"trace_files_{who}"] = sorted(os.listdir(trace_dir))  # profile() waited for every process

# ---- trackers: main process only ------------------------------------------------------------
for acc in (ours, theirs):
    acc.init_trackers("proj", config={"lr": 0.5})
    acc.log({"loss": 1.0 + rank}, step=1)
    acc.log({"loss": 0.5}, step=2)
results["trackers_ours"] = [t.name for t in ours.trackers]
results["trackers_theirs"] = [t.name for t in theirs.trackers]
results["blank_ours"] = type(ours.get_tracker("recorder")).__name__
results["blank_theirs"] = type(theirs.get_tracker("recorder")).__name__
ours.end_training()  # closes the trackers; the process group goes with the first end_training
theirs.end_training()
results["calls_ours"] = ours_rec.calls
results["calls_theirs"] = theirs_rec.calls

with open(os.path.join(shared, f"results_{rank}.json"), "w") as f:
    json.dump(results, f)
print(f"around loop done on rank {rank}")

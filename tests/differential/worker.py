"""One launched process group running a batch of cases: subject, then reference, compared.

Usage (by run.py): worker.py CASES_JSON RESULTS_JSONL. Rank 0 appends one JSON line per case:
{"seed", "errors"}. A case that raises ends the batch (a rank that raised may have left the
others inside a collective); run.py relaunches the rest.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from differential import compare, reference, reference_ds, reference_fsdp, subject  # noqa: E402
from differential import workload as W  # noqa: E402
from accelerate_c import collectives  # noqa: E402


def _all_errors(mine: list[str]) -> list[str]:
    if not dist.is_initialized():
        return mine
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = []
    for rank, errs in enumerate(everyone):
        out += [f"rank {rank}: {e}" for e in errs]
    return out


def main(cases_path: str, out_path: str) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("AC_DIFF_TIMEOUT", "90"))))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if os.environ.get("AC_DIFF_HOSTS"):  # run.py --hosts: this rank's "host", read when the subject picks its comm
        os.environ["ACCELERATE_C_SHM_HOST_ID"] = f"host-{rank % int(os.environ['AC_DIFF_HOSTS'])}"
    torch.set_num_threads(1)
    with open(cases_path) as f:
        cases = json.load(f)
    for case in cases:
        if case.get("overflow") is not None:
            case["overflow"] = tuple(case["overflow"])
        t0 = time.perf_counter()
        try:
            sub = subject.run(case)
            if os.environ.get("ACCELERATE_C_COMM") == "shm" and dist.is_initialized() and \
                    collectives.cpu_comm() != "shm":  # the shm axis (run.py --comm shm) must really run over shm
                raise RuntimeError("ACCELERATE_C_COMM=shm, but the CPU collectives went through gloo")
            if sub.get("params_in_windows") is False:
                raise RuntimeError("over shared memory, a ZeRO parameter buffer was not placed in a shared window")
            if os.environ.get("ACCELERATE_C_SHM_WINDOWS") == "0" and collectives.windows_used():
                raise RuntimeError("ACCELERATE_C_SHM_WINDOWS=0, but a gradient buffer was placed in a shared window")
            if os.environ.get("AC_DIFF_HOSTS") and dist.is_initialized() and dist.get_world_size() > 1 and \
                    not collectives.hierarchical():
                raise RuntimeError("run.py --hosts: the ranks' collectives were not split by host")
            t1 = time.perf_counter()
            ref = (reference_ds if W.deepspeed_16bit(case) else reference_fsdp if W.fsdp_16bit(case)
                   else reference).run(case)
            errors = compare.compare(case, sub, ref)
            if os.environ.get("AC_DIFF_TIMES") and rank == 0:
                print(f"case {case['seed']}: subject {t1 - t0:.2f} s, reference {time.perf_counter() - t1:.2f} s"
                      + (" (resumed)" if sub.get("resumed") else ""), file=sys.stderr, flush=True)
            crashed = False
        except Exception:
            errors = ["raised: " + traceback.format_exc(limit=6).strip().replace("\n", "\n    ")]
            crashed = True
        if crashed:
            # the other ranks may be stuck in a collective: report alone and stop
            with open(f"{out_path}.rank{rank}", "a") as f:
                f.write(json.dumps({"seed": case["seed"], "errors": [f"rank {rank}: {e}" for e in errors]}) + "\n")
            sys.stdout.flush()
            os._exit(3)
        errors = _all_errors(errors)
        if rank == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps({"seed": case["seed"], "errors": errors,
                                    "resumed": bool(not crashed and sub.get("resumed"))}) + "\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1], sys.argv[2])
    # Every result is in its file by now. Leave without finalizing the interpreter: the
    # reference's torch DDP (and torch's checkpoint in backward) launch gloo work holding Python
    # objects, and a gloo worker that releases one while the interpreter finalizes aborts the
    # process ("terminate called without an active exception") after a run that passed. That
    # race is torch's and is not what the harness compares; accelerate_c's own exit is tested
    # by tests/test_exit.py.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)

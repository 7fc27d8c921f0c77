"""Run through the launcher: the last rank dies; the job must end non-zero, not hang."""
import os
import time

import torch.distributed as dist

from accelerate_c import Accelerator

acc = Accelerator(cpu=True)
if acc.process_index == acc.num_processes - 1:
    os._exit(3)
time.sleep(1.0)
dist.barrier()  # never completes: torchrun tears the job down when the rank dies

"""What bench_step.py's three parts share: the constants of the model and loop, the device
they run on, and building a contender's model, optimizer, schedule and loader from one seed."""
from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader

from models import GPT

import accelerate_c
import accelerate_c.state

try:
    import accelerate
    import accelerate.state
    ACCELERATE_ERROR = None
except Exception as e:  # not installed, or broken
    accelerate = None
    ACCELERATE_ERROR = f"{type(e).__name__}: {e}"

SEED = 1234
DATA_SEED = 4321
ACCUM = 2
MAX_NORM = 1.0
LR = 3e-4
WARMUP_LR_STEPS = 20
# median(accelerate_c) / median(accelerate), per table (process setting)
TARGET_VS_ACCELERATE = {"defaults": 0.99, "tuned": 1.00}
BENCH = "bench_step"  # its name in the result lines (benchmarks/_targets.py)
TARGET_FP16_SPEEDUP = 1.5
CHILD_TIMEOUT_S = 1800  # a child process (one repeat, or the fp16 part) that hangs stops the benchmark
FP16_SCALE = 65536.0
FP16_RTOL = 1e-6
TORCH_NORM_SANITY = 1e-3
# Losses of the three contenders after the same steps from the same seed: the computations are
# the same bf16 autocast ops on the same data, and only the gradient norm (hence the clip
# coefficient) is summed in a different order; a few bf16 ulps (2^-8 relative each) is plenty.
LOSS_RTOL = 2e-2
# On the GPU: bf16 cuBLAS GEMMs and fused attention, and atomics-based reductions in some backward
# kernels (and in accelerate_c's norm), so neither run-to-run nor contender-to-contender bitwise
# equal; still far below what a broken step (no clipping, wrong accumulation, NaNs) produces.
LOSS_RTOL_CUDA = 3e-2
# accelerate_c's CUDA stats kernel sums squares in fp64 per block but adds the (up to 4096)
# block partials with fp32 atomicAdd: the norm is good to ~1e-6, not 1e-7 as on the CPU.
FP16_RTOL_CUDA = 1e-5
DEFAULT_BATCH = {"cpu": 4, "cuda": 16}
DEVICE = torch.device("cpu")  # set by bench_step.main() from --device (set_device)



def set_device(device: torch.device) -> None:
    global DEVICE
    DEVICE = device


def on_cuda() -> bool:
    return DEVICE.type == "cuda"


def now() -> float:
    """time.perf_counter(), after the GPU has finished all queued work (--device cuda): every
    timer read goes through here, so a timed region ends with a synchronize."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter()


def device_note() -> str:
    return "" if not on_cuda() else " (cuda)"


def reset_singletons():
    """Fresh process-wide states, so every contender builds its Accelerator from scratch."""
    if accelerate is not None:
        accelerate.state.AcceleratorState._reset_state(True)
        accelerate.state.GradientState._reset_state()
    accelerate_c.state.AcceleratorState._reset_state()
    accelerate_c.state.GradientState._reset_state()


def build(cfg, dataset, batch_size, device=None):
    """Model, AdamW, LR schedule and loader, the same for every contender (same seed). `device`:
    move the model there before building the optimizer (the torch contender on a GPU; the
    Accelerators' prepare() moves theirs)."""
    torch.manual_seed(SEED)
    model = GPT(cfg)
    if device is not None:
        model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP_LR_STEPS))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=True)
    return model, opt, sched, loader

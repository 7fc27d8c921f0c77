"""Run by tests/test_compile_prepared.py through `accelerate-c launch --num_processes 2 --cpu
--config_file C` whose dynamo_config names the "eager" backend (the same torch ops as the eager
model) or "aot_eager" (EXPECT_DYNAMO_BACKEND=AOT_EAGER: AOTAutograd's compiled backward, where the
gradient hooks fire after the whole graph's backward): the Accelerator built from the launcher's
settings compiles the model in prepare(), as accelerate does. argv[1] picks the strategy: "ddp",
"zero2" (a DeepSpeedPlugin: compiled in place, as accelerate compiles DeepSpeed's module), or
"fsdp" (full sharding). Against torch DDP over the same group, compiled alike (torch.compile
of the DDP model, the eager backend), same seed and data, accumulation 2 and clipping. Prints
"compile OK <kind>" when the parameters are torch's within the strategy's tolerance, the losses
agree, and dynamo really compiled the prepared model."""
import os
import shutil
import sys
import tempfile

import torch
import torch._dynamo.utils as dynamo_utils
from torch import nn
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP

from accelerate_c import Accelerator
from accelerate_c.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

kind = sys.argv[1]
# how the model reaches training: "direct" (prepared with the optimizer), "eval_first" (prepared for
# evaluation first, then the wrapper prepare() returned is prepared with the optimizer, as a
# Trainer that evaluates before training), "free_memory" (prepared, free_memory(), then the wrapper
# prepared again: the same model, not a second one)
flow = sys.argv[2] if len(sys.argv) > 2 else "direct"
STEPS, ACCUM, MAX_NORM = 3, 2, 0.5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x)) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


kw = {}
if kind == "zero2":
    kw["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=ACCUM, gradient_clipping=MAX_NORM)
else:
    kw["gradient_accumulation_steps"] = ACCUM
    if kind == "fsdp":
        kw["fsdp_plugin"] = FullyShardedDataParallelPlugin()
acc = Accelerator(**kw)
plugin = acc.state.dynamo_plugin
backend = os.environ.get("EXPECT_DYNAMO_BACKEND", "EAGER")
assert str(plugin.backend.value) == backend, f"the launcher's dynamo_config did not reach the Accelerator: {plugin}"
rank = acc.process_index
torch.manual_seed(0)
model, ref = Net(), Net()
ref.load_state_dict(model.state_dict())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ref_ddp = DDP(ref)
ref_opt = torch.optim.AdamW(ref_ddp.parameters(), lr=1e-2)
ref_fwd = torch.compile(ref_ddp, backend=backend.lower())
loader = torch.utils.data.DataLoader(list(range(16)), batch_size=2)  # fills DeepSpeed's batch sizes
if flow == "eval_first":
    wrapper = acc.prepare_model(model, evaluation_mode=True)
    prepared, opt, loader = acc.prepare(wrapper, opt, loader)
    if prepared is not wrapper:
        raise SystemExit(f"{kind}: preparing the evaluation wrapper for training returned another object")
elif flow == "free_memory":
    wrapper, opt, loader = acc.prepare(model, opt, loader)
    acc.free_memory()
    prepared, opt, loader = acc.prepare(wrapper, opt, loader)
    if prepared is not wrapper:
        raise SystemExit(f"{kind}: preparing the wrapper again after free_memory() returned another object")
else:
    prepared, opt, loader = acc.prepare(model, opt, loader)
gen = torch.Generator().manual_seed(7 + rank)
batches = [torch.randn(4, 8, generator=gen) for _ in range(STEPS * ACCUM)]
fails, losses, ref_losses = [], [], []
graphs = dynamo_utils.counters["stats"]["unique_graphs"]
for x in batches:  # accelerate_c first, alone: the graphs dynamo makes meanwhile are its
    with acc.accumulate(prepared):
        loss = prepared(x).square().mean()
        acc.backward(loss)
        if acc.sync_gradients and kind != "zero2":  # DeepSpeed clips with its gradient_clipping
            acc.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        if flow != "eval_first":
            opt.zero_grad()
        elif acc.sync_gradients:
            # the model's zero_grad through the wrapper (under full sharding the strategy's, which
            # clears the gradient shards), after each optimizer step (the optimizer's is skipped
            # by accumulate() on the other micro-batches; the model's is not)
            prepared.zero_grad()
    losses.append(loss.item())
if dynamo_utils.counters["stats"]["unique_graphs"] <= graphs:
    fails.append(f"{kind}: dynamo compiled no graph of the prepared model")
for i, x in enumerate(batches):
    last = (i + 1) % ACCUM == 0
    ctx = ref_ddp.no_sync() if not last else torch.enable_grad()
    with ctx:
        ref_loss = ref_fwd(x).square().mean()
        (ref_loss / ACCUM).backward()
    if last:
        torch.nn.utils.clip_grad_norm_(ref_ddp.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
    ref_losses.append(ref_loss.item())
expected = "Net" if kind == "zero2" else "OptimizedModule"
if type(prepared).__name__ != expected:
    fails.append(f"{kind}: prepare() returned {type(prepared).__name__}, expected {expected}")
if kind == "zero2" and getattr(prepared, "_compiled_call_impl", None) is None:
    fails.append("zero2: the model was not compiled in place (Module.compile)")
# the clip norms: ours in double, torch's per-tensor fp32 norms (a last-bit difference may move
# the parameters by an ulp or so)
tol = dict(rtol=1e-5, atol=1e-6)
for a, b in zip(losses, ref_losses):
    if abs(a - b) > 1e-5 * abs(b) + 1e-6:
        fails.append(f"{kind}: loss {a} vs torch DDP's {b}")
sd = acc.get_state_dict(prepared)
if flow == "free_memory":
    # save_state writes the model registered once, under its own names (a wrapper registered as a
    # second model would be saved with torch.compile's `_orig_mod.` names)
    holder = [tempfile.mkdtemp() if acc.is_main_process else None]
    torch.distributed.broadcast_object_list(holder, src=0)
    acc.save_state(holder[0])
    if acc.is_main_process:
        names = sorted(os.listdir(holder[0]))
        keys = sorted(load_file(os.path.join(holder[0], "model.safetensors")))
        if any("_orig_mod" in k for k in keys) or "model_1.safetensors" in names:
            fails.append(f"{kind}: save_state after re-preparing the wrapper wrote {names}, keys {keys[:2]}")
    acc.wait_for_everyone()
    if acc.is_main_process:
        shutil.rmtree(holder[0], ignore_errors=True)
if acc.is_main_process:
    full = {k.replace("_orig_mod.", ""): v for k, v in sd.items()}
    for name, q in ref.named_parameters():
        if not torch.allclose(full[name].float(), q.detach(), **tol):
            fails.append(f"{kind}: {name} differs from torch DDP's by {(full[name] - q).abs().max().item():.3g}")
acc.wait_for_everyone()
if fails:
    raise SystemExit("compile FAILED on rank %d:\n  " % rank + "\n  ".join(fails))
if acc.is_main_process:
    print(f"compile OK {kind} {flow}")

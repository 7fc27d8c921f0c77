"""What the clip tests share (tests/test_clip_hook_sums.py for the flat buffers,
tests/test_loose_grads.py for one process without them): small models, and a four-step loop
beside torch in which one step's gradients are written to after backward."""
import copy

import torch
from torch import nn

from accelerate_c import Accelerator
from counting_kernels import counting_reads
from helpers import assert_params_close, assert_rel, batches_of, loss_function, make_loader, make_model, \
    make_optimizer, tols


class HalfAndFull(nn.Module):
    """A bf16 layer and an fp32 layer: two buffers, each measured in its own hooks."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16).to(torch.bfloat16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.to(torch.bfloat16))).float())


class WithBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, use_branch=True):
        h = torch.relu(self.fc1(x))
        if use_branch:
            h = h + torch.relu(self.branch(h))
        return self.fc2(h)


class Checkpointed(nn.Module):
    """A reentrant-checkpointed segment whose weight is also used outside it: its gradient is
    accumulated twice in one backward (two hooks), by two graph tasks."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.fc1(t)), x, use_reentrant=True)
        return self.fc2(self.fc1(h))


def run_write_scenario(write: str, second_clip_reads: int):
    """Four steps of WithBranch (SGD, clip at 0.05) beside torch on a copy given the same data
    and writes; on step 2 `write` (a name in the tests' WRITES tables) changes the gradients
    after backward ("hook_mul": a user's hook scales one in the middle of the backward;
    "no_grad_param*": a layer gets no gradient; "clip_twice": a second clip, which must read
    `second_clip_reads` times). Every norm, gradient and parameter is checked against torch's;
    returns (the read passes each clip made, the Accelerator)."""
    fp16 = write == "unscale_fp16"
    model = make_model(0, cls=WithBranch)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator(mixed_precision="fp16" if fp16 else "no", cpu=True)
    optimizer = make_optimizer("sgd", model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    ref_opt = make_optimizer("sgd", ref_model.parameters())
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    max_norm = 0.05
    rtol, atol = tols("fp16" if fp16 else "no")

    def scaled_in_hook(m, step_holder):
        def hook(p):
            if step_holder[0] == 2:
                p.grad.mul_(3.0)
        return m.fc2.weight.register_post_accumulate_grad_hook(hook)

    step_holder = [0]
    if write == "hook_mul":  # registered after prepare: runs after accelerate_c's own hook
        scaled_in_hook(model, step_holder)
        scaled_in_hook(ref_model, step_holder)

    def apply_write(m, opt_unscale):
        if write == "grad_assign":
            m.fc1.weight.grad = m.fc1.weight.grad * 2.0
        elif write == "grad_assign_and_grad_mul":
            m.fc1.weight.grad = m.fc1.weight.grad * 2.0
            m.fc2.weight.grad.mul_(0.5)  # unmeasured, before resync measures the assigned one
        elif write == "grad_mul":
            m.fc2.bias.grad.mul_(2.0)
        elif write == "grad_data_mul":
            m.fc2.bias.grad.data.mul_(2.0)
        elif write == "grad_data_assign":
            m.fc2.bias.grad.data = m.fc2.bias.grad * 2.0
        elif write == "grad_data_read":
            float(m.fc2.bias.grad.data.norm())
        elif write == "unscale_fp16":
            opt_unscale()

    set_to_none = write != "no_grad_param_zeros"
    batches = batches_of(make_loader(n=16, batch_size=4))
    reads = []
    for step, (inputs, targets) in enumerate(batches):
        step_holder[0] = step
        use_branch = not (write.startswith("no_grad_param") and step == 2)
        # torch
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):  # as the fp16 Accelerator's forward
            out = ref_model(inputs, use_branch).float()
        loss = loss_function(out, targets)
        (scaler.scale(loss) if fp16 else loss).backward()
        if step == 2:
            apply_write(ref_model, lambda: scaler.unscale_(ref_opt))
        if fp16 and not (step == 2 and write == "unscale_fp16"):
            scaler.unscale_(ref_opt)
        want = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        twice = write == "clip_twice" and step == 2
        want2 = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm) if twice else None
        # accelerate_c
        accelerator.backward(loss_function(model(inputs, use_branch), targets))
        if step == 2:
            apply_write(model, accelerator.unscale_gradients)
        with counting_reads() as c:
            got = accelerator.clip_grad_norm_(model.parameters(), max_norm)
        reads.append(c.reads)
        assert_rel(got, want, msg=f"{write}: step {step} norm")
        if want2 is not None:
            with counting_reads() as c:
                got2 = accelerator.clip_grad_norm_(model.parameters(), max_norm)
            assert c.reads == second_clip_reads, "the second clip trusted the sums of the gradients before the first"
            assert_rel(got2, want2, msg=f"{write}: step {step} second norm")
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            if q.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol,
                                           msg=lambda m, n=name: f"{write}: step {step} grad {n}: {m}")
        if fp16:
            scaler.step(ref_opt)
            scaler.update()
        else:
            ref_opt.step()
        optimizer.step()
        ref_opt.zero_grad(set_to_none=set_to_none)
        optimizer.zero_grad(set_to_none=set_to_none)
    assert_params_close(model, ref_model, rtol=rtol, atol=atol, msg=write)
    return reads, accelerator

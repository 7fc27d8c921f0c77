"""What tests/scripts/shm_select.py and shm_hier.py both check after the Accelerator picked
shared memory: a model prepared now has its gradient buffer in a shared window, and the averaged
gradients it gets equal torch's (every rank's own gradient all-reduced through gloo, divided by
the number of processes)."""
import torch
import torch.distributed as dist

from accelerate_c import collectives


def check_window_gradients(acc, x):
    model = acc.prepare(torch.nn.Linear(x.shape[1], 3))
    w, bias = (t.detach().clone().requires_grad_() for t in (model.weight, model.bias))
    torch.nn.functional.linear(x, w, bias).square().mean().backward()
    acc.backward(model(x).square().mean())
    for mine, ref in ((model.weight.grad, w.grad), (model.bias.grad, bias.grad)):
        assert collectives.in_shared_buffer(mine)
        dist.all_reduce(ref)
        assert torch.allclose(mine, ref / acc.num_processes, rtol=1e-6, atol=1e-6), (mine, ref / acc.num_processes)

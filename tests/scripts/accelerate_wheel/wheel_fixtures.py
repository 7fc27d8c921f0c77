"""Test fixtures of accelerate.test_utils that cannot be used as they are against accelerate_c.

accelerate's `are_the_same_tensors` reads accelerate's own AcceleratorState, which only
accelerate's Accelerator initialises (against accelerate_c it raises "Please make sure to
properly initialize your accelerator"). This is the same check written with torch.distributed
alone, so it neither depends on nor exercises accelerate_c."""
import torch
import torch.distributed as dist


def are_the_same_tensors(tensor):
    """True when every process holds a tensor equal to this one (accelerate's fixture)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    tensor = tensor.detach().clone().contiguous().cpu()
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor)
    return all(torch.equal(t, tensor) for t in everyone)

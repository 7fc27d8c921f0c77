"""Models on the meta device at prepare, on 2 processes (tests/test_fsdp.py): a model that only
the main process holds for real is loaded by full sharding (tests/scripts/fsdp_seed_llama.py)
and refused by name everywhere else, on every process (an error, not a hang); a main process
without real weights is refused even under full sharding. The errors are held to what the
processes hold, checked in the same run."""
from __future__ import annotations

import torch

from accelerate_c import Accelerator
from accelerate_c.strategies.replicas import check_same_structure


def net(meta: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def expect_error(fn, *needles):
    try:
        fn()
    except ValueError as e:
        missing = [n for n in needles if n not in str(e)]
        assert not missing, (missing, str(e))
        return
    raise AssertionError(f"no error; expected one naming {needles}")


def main():
    acc = Accelerator(cpu=True)
    rank = acc.process_index
    # data parallelism needs every process's weights: a meta model on process 1 is refused by
    # name on both processes, before any weight is broadcast
    model = net(meta=rank == 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expect_error(lambda: acc.prepare(model, opt), "rank 1 has parameter '0.weight' on the meta device",
                 "only full sharding")
    # the refused model is not prepared: given real storage, preparing it again does the work
    # (every process then holds rank 0's weights, what DDP's broadcast gives)
    if rank == 1:
        model.to_empty(device="cpu")
    model, opt = acc.prepare(model, opt)
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(acc.num_processes)]
    torch.distributed.all_gather(everyone, mine)
    assert all(torch.equal(t, everyone[0]) for t in everyone), "the re-prepared model did not take rank 0's weights"
    assert torch.equal(everyone[0], torch.cat([p.detach().reshape(-1) for p in net(meta=False).parameters()]))
    # the process every other one takes its weights from must hold them, full sharding too
    expect_error(lambda: check_same_structure(net(meta=rank == 0), src=0, allow_meta=True),
                 "rank 0 has parameter '0.weight' on the meta device")
    check_same_structure(net(meta=rank == 1), src=0, allow_meta=True)  # what full sharding loads
    frozen = net(meta=False)
    frozen[1].bias.requires_grad_(rank == 0)  # full sharding groups by trainable: a difference is named
    expect_error(lambda: check_same_structure(frozen, src=0), "rank 1 has parameter '1.bias'")
    acc.wait_for_everyone()
    if rank == 0:
        print("meta models refused OK on 2 processes")


if __name__ == "__main__":
    main()

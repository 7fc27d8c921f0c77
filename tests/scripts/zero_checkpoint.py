"""Sharded checkpoints under ZeRO (launched by tests/test_zero_checkpoint.py, twice per case);
STAGE 3 is full sharding through accelerate's FullyShardedDataParallelPlugin (FSDP2):

    zero_checkpoint.py save DIR STAGE PRECISION [STATE_DICT_TYPE]  (on N processes)
    zero_checkpoint.py load DIR STAGE PRECISION [STATE_DICT_TYPE]  (on M processes, any M)
    zero_checkpoint.py kill DIR STAGE PRECISION   (save, then a second save that the test kills)

`save`: STEPS optimizer steps of a user's loop under DeepSpeedPlugin(zero_stage=STAGE), save_state,
STEPS more; the main process records the uninterrupted run's parameters after each of the later
steps (DIR/uninterrupted.pt), and checks that each process wrote its own shard files and that no
file holds more than this process's part of the optimizer state.
`load`: a fresh process group of another size builds the same loop, load_state, and trains the
same STEPS later steps with the same global batches (each global batch split evenly between the
processes, no dropout): the parameters after every step within 1e-5 (fp32) of the uninterrupted
run; bf16: bit for bit on the same number of processes, 2e-2 on another (load() says why). Then the refusals, each leaving the job as it was: a process's shard file
missing, one truncated, a plan from another model.
"""
from __future__ import annotations

import os
import shutil
import sys

import torch
import torch.distributed as dist

from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

from accelerate_c import Accelerator

STEPS = 3
# full sharding's state dict type (argument 5; accelerate's FSDP2 default): SHARDED_STATE_DICT saves
# each process's shard of the weights, FULL_STATE_DICT the gathered weights once; FROM3 on a load
# under stage 1/2: the checkpoint was saved under full sharding
SDT = sys.argv[5] if len(sys.argv) > 5 else "SHARDED_STATE_DICT"
BF16_MODEL = False  # PRECISION bf16model (set by main(); scripts importing build() keep fp32)
GLOBAL = 12  # samples per global batch: divisible by 1, 2, 3 and 4 processes


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(29, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.GELU(), torch.nn.Linear(40, 16))
        self.head = torch.nn.Linear(16, 29)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        return self.head(self.body(self.emb(x).mean(1)))


def build(extra: int = 0):
    torch.manual_seed(0)
    model = Net()
    if BF16_MODEL:  # a 16-bit model without mixed precision (from_pretrained(torch_dtype=bf16))
        model.to(torch.bfloat16)
    if extra:  # "another model": one layer wider
        model.body[2] = torch.nn.Linear(40 + extra, 16)
        model.body[0] = torch.nn.Linear(16, 40 + extra)
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
              {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0, "lr": 5e-3}]
    return model, torch.optim.AdamW(groups, lr=1e-2)


def global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 29, (GLOBAL, 5), generator=g), torch.randint(0, 29, (GLOBAL,), generator=g)


def local(step, rank, world):
    x, y = global_batch(step)
    n = GLOBAL // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def accelerator(stage, precision, clip: bool = True):
    if stage == 3:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=300,
                                                state_dict_type=SDT)
        return Accelerator(cpu=True, mixed_precision="no" if precision == "bf16model" else precision,
                           fsdp_plugin=plugin)
    cfg = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(),
           "gradient_accumulation_steps": 1, "gradient_clipping": 1.0 if clip else 0.0}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))


def train(acc, model, opt, first, rank, world):
    out = []
    for step in range(first, first + STEPS):
        x, y = local(step, rank, world)
        acc.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
        opt.step()
        opt.zero_grad()
        out.append(values(acc, model))
    return out


def values(acc, model):
    """The parameters in model order, whole (under full sharding each process holds a shard)."""
    sd = acc.get_state_dict(model)  # under full sharding the main process's ({} elsewhere)
    if dist.get_world_size() > 1:
        box = [sd]
        dist.broadcast_object_list(box, src=0)
        sd = box[0]
    return [sd[n].float().clone() for n, _ in model.named_parameters()]


def save(directory, stage, precision):
    rank, world = dist.get_rank(), dist.get_world_size()
    acc = accelerator(stage, precision)
    model, opt = build()
    model, opt = acc.prepare(model, opt)
    train(acc, model, opt, 0, rank, world)
    at_save = dict(zip([n for n, _ in model.named_parameters()], values(acc, model)))  # gathered: collectives
    acc.save_state(os.path.join(directory, "ckpt"))
    later = train(acc, model, opt, STEPS, rank, world)
    ckpt = os.path.join(directory, "ckpt")
    mine = [os.path.join(ckpt, f"zero_optimizer_rank{rank}.safetensors")]
    if stage == 3 and SDT == "SHARDED_STATE_DICT":  # the weights too: each process its shard, nobody the whole
        mine.append(os.path.join(ckpt, f"model_shard_rank{rank}.safetensors"))
        assert not os.path.exists(os.path.join(ckpt, "model.safetensors")), sorted(os.listdir(ckpt))
    psi = sum(p.numel() for p in model.parameters())
    from accelerate_c.safetensors_io import list_tensors
    for path in mine:
        assert os.path.isfile(path), sorted(os.listdir(ckpt))
        for name, info in list_tensors(path).items():  # this process's part only, never the whole state
            assert info.shape[0] < psi, (path, name, info.shape, psi)
    _LAST["acc"] = acc
    if rank == 0:
        torch.save({"world": world, "params": later, "at_save": at_save}, os.path.join(directory, "uninterrupted.pt"))
        print(f"saved on {world}: {sorted(os.listdir(ckpt))}")


def kill(directory, stage, precision):
    """save(), then a second save_state in which process 1 pauses after its first file (the test
    kills it there with SIGKILL)."""
    save(directory, stage, precision)
    acc = _LAST["acc"]
    if dist.get_rank() == 1:
        from accelerate_c.checkpointing import PAUSE_ENV
        os.environ[PAUSE_ENV] = os.path.join(directory, "paused")
    acc.save_state(os.path.join(directory, "ckpt_b"))
    raise AssertionError("the second save was not interrupted")


_LAST: dict = {}


def load(directory, stage, precision):
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(directory, "ckpt")
    # FROM3: a full-sharding checkpoint loaded under ZeRO stage 1/2 (clipping off, as it was saved)
    acc = accelerator(stage, precision, clip=SDT != "FROM3")
    model, opt = build()
    model, opt = acc.prepare(model, opt)
    acc.load_state(ckpt)
    got = train(acc, model, opt, STEPS, rank, world)
    saved = torch.load(os.path.join(directory, "uninterrupted.pt"))
    want = saved["params"]
    # fp32: summation order only. bf16 on the same number of processes: bit for bit (the state is
    # restored exactly); on another number the bf16 model computes each process's part of the
    # batch in other pieces, rounded to bf16, so the gradients are a bf16 rounding apart and
    # Adam's first step turns near-zero ones into whole steps (3.5e-3 measured 2 -> 3)
    tol = 1e-5 if precision == "no" else 0.0 if saved["world"] == world else 2e-2
    worst = 0.0
    for k, (a_s, b_s) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(a_s, b_s)):
            err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
            worst = max(worst, err)
            assert err <= tol, f"step {k} after the resume on {world}: parameter {j} off by {err:.3g}"
    refusals(acc, model, opt, directory, stage, precision)
    dist.barrier()
    if rank == 0:
        print(f"zero{stage} {precision} resumed on {world}: max relative error {worst:.2e}")


def _unchanged(model, opt, before):
    params, state = before
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters())), "a failed load changed the model"
    now = {id(k): {kk: vv.clone() for kk, vv in v.items() if torch.is_tensor(vv)} for k, v in opt.state.items()}
    assert now.keys() == state.keys() and all(
        all(torch.equal(now[k][kk], state[k][kk]) for kk in state[k]) for k in state), "a failed load changed the optimizer"


def refusals(acc, model, opt, directory, stage, precision):
    rank = dist.get_rank()
    ckpt = os.path.join(directory, "ckpt")
    before = ([p.detach().clone() for p in model.parameters()],
              {id(k): {kk: vv.clone() for kk, vv in v.items() if torch.is_tensor(vv)} for k, v in opt.state.items()})
    bad = os.path.join(directory, f"bad{dist.get_world_size()}")
    cases = [("missing", lambda d: os.remove(os.path.join(d, "zero_optimizer_rank1.safetensors")),
              "zero_optimizer_rank1.safetensors: missing"),
             ("truncated", lambda d: os.truncate(os.path.join(d, "zero_optimizer_rank0.safetensors"), 200),
              "zero_optimizer_rank0.safetensors")]
    if stage == 3 and SDT == "SHARDED_STATE_DICT":  # the weights' shards are held to the same standard
        cases += [("missing weights", lambda d: os.remove(os.path.join(d, "model_shard_rank1.safetensors")),
                   "model_shard_rank1.safetensors: missing"),
                  ("truncated weights", lambda d: os.truncate(os.path.join(d, "model_shard_rank0.safetensors"), 200),
                   "model_shard_rank0.safetensors"),
                  ("swapped weights", lambda d: os.replace(os.path.join(d, "model_shard_rank1.safetensors"),
                                                           os.path.join(d, "model_shard_rank0.safetensors")),
                   "model_shard_rank0.safetensors")]
    for label, damage, says in cases:
        if rank == 0:
            shutil.rmtree(bad, ignore_errors=True)
            shutil.copytree(ckpt, bad)
            damage(bad)
        dist.barrier()
        try:
            acc.load_state(bad)
        except (FileNotFoundError, ValueError) as e:
            assert says in str(e), f"{label}: {e}"
        else:
            raise AssertionError(f"a checkpoint with a {label} shard file was loaded")
        _unchanged(model, opt, before)
        dist.barrier()
    # a plan from another model: the same checkpoint loaded into a wider one
    other = accelerator(stage, precision)
    wide, wopt = build(extra=8)
    wide, wopt = other.prepare(wide, wopt)
    try:
        other.load_state(ckpt)
    except (ValueError, RuntimeError) as e:
        assert "zero_plan.json" in str(e) or "size mismatch" in str(e) or "shape" in str(e), str(e)
    else:
        raise AssertionError("a checkpoint of another model was loaded")


class _One:
    """torch.distributed's calls this script makes, on one process without a process group
    (one process does not use ZeRO: the checkpoint is loaded into a plain optimizer)."""

    @staticmethod
    def get_rank():
        return 0

    @staticmethod
    def get_world_size():
        return 1

    @staticmethod
    def barrier():
        pass


def main():
    global dist, BF16_MODEL
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist = _One()
    torch.set_num_threads(1)
    mode, directory, stage, precision = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    BF16_MODEL = precision == "bf16model"
    {"save": save, "load": load, "kill": kill}[mode](directory, stage, precision)
    sys.stdout.flush()
    if not isinstance(dist, _One):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

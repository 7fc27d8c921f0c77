"""The project's lead configuration: the FSDP config file of the transformers Trainer page
(distributed_type FSDP, fsdp_version 2, TRANSFORMER_BASED_WRAP of LlamaDecoderLayer, bf16,
4 processes), passed verbatim to `accelerate-c launch --config_file` by tests/test_fsdp.py, trains
transformers' LlamaForCausalLM. The script has no FSDP code of its own: the Accelerator reads the
launcher's variables. With a folder argument the model comes from `from_pretrained` of a local
safetensors folder (the main process writes it first) on the main process only, while the others
build it on the meta device (what cpu_ram_efficient_loading is for: one copy of the weights on
the host; transformers 4.x's from_pretrained did this itself under the launcher's FSDP
variables, 5.x loads on every process): prepare sends each process its shards, and the rotary
embedding's non-persistent buffers, from the main process.

Checked against references computed here in torch, on one process with the global batch: the
unsharded run with the same precision policy (fp32 masters, bf16 copies for the compute: 1e-3
relative) and the plain autocast run (3e-2); the run reports FSDP; each process holds ~1/N of
the parameter and optimizer-state elements between steps; generate() agrees with the
unsharded model with the gathered weights.
"""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from accelerate_c import Accelerator

STEPS, PER_RANK, SEQ, LR = 3, 2, 16, 0.05


def build():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def global_batches(world):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 96, (PER_RANK * world, SEQ), generator=g) for _ in range(STEPS)]


def reference(world, same_policy: bool):
    model, opt = build()
    for ids in global_batches(world):
        run = copy.deepcopy(model).to(torch.bfloat16) if same_policy else model
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=ids).loss
        loss.float().backward()
        if same_policy:
            for p, q in zip(model.parameters(), run.parameters()):
                p.grad = None if q.grad is None else q.grad.float()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, model


def main():
    acc = Accelerator()
    assert acc.distributed_type == "FSDP" and acc.is_fsdp2 and acc.mixed_precision == "bf16", acc.distributed_type
    rank, world = acc.process_index, acc.num_processes
    model, opt = build()
    if len(sys.argv) > 1:  # from a local folder, as the seed's users load their model
        folder = sys.argv[1]
        if acc.is_main_process:
            model.save_pretrained(folder)
        acc.wait_for_everyone()
        if acc.is_main_process:
            model = LlamaForCausalLM.from_pretrained(folder)
        else:
            with torch.device("meta"):
                model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    total = sum(p.numel() for p in model.parameters())
    model, opt = acc.prepare(model, opt)
    for ids in global_batches(world):
        mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
        loss = model(input_ids=mine, labels=mine).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    held = sum(p.numel() for p in model.parameters())
    state = sum(v.numel() for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim())
    assert held <= total / world * 1.02 + 16 * 40, (held, total)
    assert state <= total / world * 1.02 + 16 * 40, (state, total)
    got = acc.get_state_dict(model)
    # the main process's, as accelerate's get_state_dict under FSDP2 (the others get {})
    assert bool(got) == (rank == 0), sorted(got)[:3]
    box = [got]
    dist.broadcast_object_list(box, src=0)  # every process checks it
    got = box[0]
    same, _ = reference(world, same_policy=True)
    autocast, _ = reference(world, same_policy=False)
    worst = {}
    for name, ref in (("same policy", same), ("autocast", autocast)):
        err = max(((got[n].float() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for n, r in ref.items())
        worst[name] = err
    assert worst["same policy"] <= 1e-3, worst
    assert worst["autocast"] <= 3e-2, worst
    prompt = torch.tensor([[3, 14, 15, 9]])
    plain, _ = build()  # the same weights, unsharded, computing in bf16 as the policy does
    plain.load_state_dict(got)
    plain.to(torch.bfloat16)
    # each process generates a different number of tokens: transformers keeps the finished
    # ones stepping (synced_gpus, which it turns on for a model full sharding manages) so that
    # every process takes part in every unit's gather until the last one is done
    new_tokens = 2 + 2 * rank
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expect = plain.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(out, expect), (out, expect)
    dist.barrier()
    if rank == 0:
        print(f"fsdp seed llama OK on {world} processes (same policy {worst['same policy']:.2g}, "
              f"autocast {worst['autocast']:.2g}; {held} of {total} parameter elements here)")


if __name__ == "__main__":
    main()

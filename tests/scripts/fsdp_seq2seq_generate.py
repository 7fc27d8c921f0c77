"""An encoder-decoder's generate() under full sharding (launched by tests/test_fsdp.py).

transformers' T5 generate() runs the encoder through `model.get_encoder()`, outside the prepared
model's own forward, and the encoder's token embedding is the shared one (the root unit's,
tied with the decoder's and the head). Checked on N processes, each generating a different
number of tokens: the tokens equal those of the unsharded model (transformers on one process,
the same weights), before and after a training step (the weights compared to torch DDP's after
the same step, 1e-5), and nothing stays gathered after generate() apart from the root.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import T5Config, T5ForConditionalGeneration

from accelerate_c import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin


def build():
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    return T5ForConditionalGeneration(cfg).eval()


def main():
    model = build()
    plain = copy.deepcopy(model)
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
                                                                  auto_wrap_policy="TRANSFORMER_BASED_WRAP"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    rank, world = acc.process_index, acc.num_processes
    prompt = torch.tensor([[5, 9, 13, 17, 21, 25]])
    units = acc._grads.strategy.models[id(model)].units

    def check_generate(reference, what):
        new_tokens = 2 + 2 * rank  # each process its own length: the others keep stepping (synced)
        model.eval()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
            want = reference.generate(prompt, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
        assert torch.equal(out, want), f"rank {rank} {what}: {out.tolist()} != {want.tolist()}"
        left = [u.module.__class__.__name__ for u in units if u.gathered and not u.is_root]
        assert not left, f"{what}: units {left} still gathered after generate()"

    check_generate(plain, "before training")
    # one training step on every process's own pair, against torch DDP of the unsharded copy
    g = torch.Generator().manual_seed(3)
    src = torch.randint(2, 64, (world, 6), generator=g)
    tgt = torch.randint(2, 64, (world, 4), generator=g)
    model.train()
    loss = model(input_ids=src[rank:rank + 1], labels=tgt[rank:rank + 1]).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    ref = DDP(plain.train())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(input_ids=src[rank:rank + 1], labels=tgt[rank:rank + 1]).loss.backward()
    ref_opt.step()
    plain.eval()
    box = [acc.get_state_dict(model)]
    dist.broadcast_object_list(box, src=0)
    for name, v in plain.state_dict().items():
        err = (box[0][name].float() - v.float()).abs().max().item()
        assert err <= 1e-5, f"{name}: {err} from DDP after the step"
    check_generate(plain, "after a step")
    print(f"rank {rank}: seq2seq generate OK on {world} processes")


if __name__ == "__main__":
    main()

"""get_state_dict under DeepSpeed ZeRO stage 3 on N CPU processes (launched by tests/test_zero.py).

As DeepSpeed's consolidated 16-bit state dict (what accelerate returns there): the main process
gets the model's weights in the compute dtype, a tied weight one tensor under both of its names,
the others None; without stage3_gather_16bit_weights_on_model_save it is an error naming the
key. The reference: the model's own weights before prepare, cast to bf16 (prepare and a zero
learning-rate step leave them unchanged).
"""
from __future__ import annotations

import torch

import accelerate_c.state
from accelerate.utils import DeepSpeedPlugin
from accelerate_c import Accelerator


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


def main():
    torch.manual_seed(0)
    model = Net()
    want = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    plugin = DeepSpeedPlugin(zero_stage=3, zero3_save_16bit_model=True)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    acc = Accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = acc.prepare(model, opt)
    logits = model(torch.randint(0, 32, (2, 5)))
    acc.backward(logits.float().square().mean())
    opt.step()
    opt.zero_grad()
    sd = acc.get_state_dict(model)
    if acc.is_main_process:
        assert sd.keys() == want.keys(), (sorted(sd), sorted(want))
        for k, v in want.items():
            assert sd[k].dtype == torch.bfloat16, (k, sd[k].dtype)
            assert torch.equal(sd[k], v), k
        assert sd["emb.weight"] is sd["head.weight"], "the tied weight came back as two tensors"
    else:
        assert sd is None, f"process {acc.process_index}: {type(sd).__name__}, DeepSpeed gives None"
    # a fresh Accelerator whose configuration leaves the flag at its default (false)
    accelerate_c.state.AcceleratorState._reset_state()
    accelerate_c.state.GradientState._reset_state()
    plugin = DeepSpeedPlugin(zero_stage=3)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    acc = Accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    other = acc.prepare(Net())
    try:
        acc.get_state_dict(other)
    except ValueError as e:
        assert "stage3_gather_16bit_weights_on_model_save" in str(e), e
    else:
        raise AssertionError("get_state_dict without stage3_gather_16bit_weights_on_model_save returned")
    print(f"rank {acc.process_index}: zero3 state dict OK", flush=True)


if __name__ == "__main__":
    main()

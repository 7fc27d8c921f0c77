"""Full sharding under torch.compile with a unit run again outside the compiled forward (an extra
loss from the output layer called directly), on 2 processes: compiled through the Accelerator's
dynamo plugin ("plugin") or by the user before prepare() ("user"); the parameters after 3 SGD
steps against plain torch on the whole batch. Each had the output layer's gradient delivered twice
(refused) until the units' hooks ran outside dynamo's tracing (FullShardStrategy.before_compile).

    accelerate-c launch --num_processes 2 --cpu fsdp_compile_aux.py plugin|user
"""
import sys

import torch

from accelerate_c import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, TorchDynamoPlugin

HOW = sys.argv[1]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = (torch.nn.Linear(12, 12) for _ in range(3))

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def loss_of(model, out_layer, x):
    return model(x).pow(2).mean() + 0.1 * out_layer(x).pow(2).mean()


def main():
    torch.manual_seed(0)
    ref = Net()
    net = Net()
    net.load_state_dict(ref.state_dict())
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                            reshard_after_forward=True, transformer_cls_names_to_wrap=["Linear"])
    dynamo = TorchDynamoPlugin(backend="eager") if HOW == "plugin" else None
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, dynamo_plugin=dynamo)
    model = torch.compile(net, backend="eager") if HOW == "user" else net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    data = torch.randn(3, 8, 12, generator=torch.Generator().manual_seed(1))
    mine = data[:, acc.process_index * 4:(acc.process_index + 1) * 4]  # this process's half of each batch
    for x in mine:
        acc.backward(loss_of(model, acc.unwrap_model(model).out, x))
        opt.step()
        opt.zero_grad()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in data:  # the whole batch: the mean of the two halves' means
        loss_of(ref, ref.out, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = acc.get_state_dict(model)
    got = {k.removeprefix("_orig_mod."): v for k, v in full.items()} if full else {}
    if acc.is_main_process:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    acc.wait_for_everyone()
    print(f"fsdp compile aux OK ({HOW})", flush=True)


if __name__ == "__main__":
    main()

"""The tutorial loop (accumulate, clip_grad_norm_, an LR scheduler, gather_for_metrics) that a
user ends by simply returning: the 50-run exit measurement of issue 11 launches it 50 times on 2
CPU ranks and counts exits with status 0 and no "terminate called" (see the session notes):

    for i in $(seq 50); do accelerate-c launch --num_processes 2 --cpu --main_process_port 0 \
        tests/scripts/tutorial_exit.py; done
"""
import torch
from accelerate_c import Accelerator
from accelerate_c.utils import set_seed
set_seed(0)
acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
ds = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,)))
dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True)
ev = torch.utils.data.DataLoader(ds, batch_size=33)
model, opt, dl, ev, sched = acc.prepare(model, opt, dl, ev, sched)
for epoch in range(3):
    model.train()
    for x, y in dl:
        with acc.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sched.step(); opt.zero_grad()
    model.eval()
    correct = 0
    for x, y in ev:
        with torch.no_grad():
            pred = model(x).argmax(-1)
        p, r = acc.gather_for_metrics((pred, y))
        correct += (p == r).sum().item()
    acc.print(epoch, correct)
acc.wait_for_everyone()
acc.print("done")

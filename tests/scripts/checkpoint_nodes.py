"""Run by tests/test_checkpoint_resume.py as 2 launchers ("nodes") x 2 processes on one host, so both
nodes' local main processes write to one shared directory with save_on_each_node=True.

    checkpoint_nodes.py OUTDIR

Saves twice into OUTDIR/ck (a new directory, then over the existing one), records the weights it
saved (rank 0: OUTDIR/params.pt, plain torch.save) and each rank's first random draw after the
save; then changes the weights, load_state()s, draws again and records both in
OUTDIR/nodes_<rank>.json for the test to compare.
"""
import json
import os
import sys

import torch
from torch import nn

from accelerate_c import Accelerator, ProjectConfiguration

out = sys.argv[1]
acc = Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=True))
rank = acc.process_index
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = acc.prepare(model, opt)
torch.manual_seed(100 + rank)  # every rank's generator in its own state
for step in range(2):
    acc.backward(model(torch.randn(3, 4)).square().mean())
    opt.step()
    opt.zero_grad()
    if step == 0:
        acc.save_state(os.path.join(out, "ck"))
acc.save_state(os.path.join(out, "ck"))  # over the existing directory
drawn = torch.rand(4).tolist()
saved = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
if rank == 0:
    torch.save(saved, os.path.join(out, "params.pt"))
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
torch.manual_seed(7)
acc.load_state(os.path.join(out, "ck"))
restored = all(torch.equal(v, saved[k]) for k, v in acc.unwrap_model(model).state_dict().items())
with open(os.path.join(out, f"nodes_{rank}.json"), "w") as f:
    json.dump({"node": os.environ.get("GROUP_RANK"), "local": acc.local_process_index, "drawn": drawn,
               "drawn_after_load": torch.rand(4).tolist(), "restored": restored}, f)
acc.wait_for_everyone()
print(f"checkpoint_nodes OK rank {rank}", flush=True)

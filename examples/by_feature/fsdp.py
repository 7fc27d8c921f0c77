"""FSDP with the project's seed config (the transformers Trainer page's FSDP config file: fsdp_version 2, LlamaDecoderLayer wrapped, bf16, 4 processes): a plain loop over a tiny LlamaForCausalLM, the sharding all in the config. Launch: accelerate-c launch --config_file tests/data/fsdp_seed_config.yaml --cpu examples/by_feature/fsdp.py (the tests add --num_processes 2 to keep it quick)

The script has no FSDP code: the launcher exports the config's FSDP_* variables and the
Accelerator reads them. Each process holds ~1/N of the parameters and of the optimizer state
between steps; forward and backward gather one LlamaDecoderLayer at a time. At the end the
full weights are gathered (get_state_dict: a collective, every process takes part) and the main
process writes them with save_pretrained, which LlamaForCausalLM.from_pretrained reads back."""
import argparse
import math
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import llama_task  # noqa: E402

from accelerate_c import Accelerator  # noqa: E402
from accelerate_c.utils import set_seed  # noqa: E402


def evaluate(accelerator, model, loader) -> float:
    """Mean loss over the evaluation set, each sample counted once across processes."""
    model.eval()
    losses = []
    with torch.no_grad():
        for batch in loader:
            loss = model(**batch).loss.float()
            losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].shape[0])))
    model.train()
    return torch.cat(losses).mean().item()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="train on CPU processes")
    parser.add_argument("--train_size", type=int, default=512)
    parser.add_argument("--eval_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=8, help="per process")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--max_train_steps", type=int, default=60)
    parser.add_argument("--output_dir", default=None, help="save_pretrained the trained model here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu)
    set_seed(args.seed)
    model = llama_task.make_model(args.seed)
    total = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_dl = DataLoader(llama_task.make_samples(args.train_size, seed=1), batch_size=args.batch_size, shuffle=True)
    eval_dl = DataLoader(llama_task.make_samples(args.eval_size, seed=2), batch_size=args.batch_size)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    held = sum(p.numel() for p in model.parameters())  # this process's shards
    first_eval = evaluate(accelerator, model, eval_dl)
    step = 0
    while step < args.max_train_steps:
        for batch in train_dl:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step >= args.max_train_steps:
                break
    last_eval = evaluate(accelerator, model, eval_dl)
    accelerator.print(f"{accelerator.distributed_type.value} on {accelerator.num_processes} processes, "
                      f"{accelerator.mixed_precision}: "
                      f"eval loss {first_eval:.3f} -> {last_eval:.3f} after {step} steps "
                      f"(uniform guess: {math.log(llama_task.VOCAB):.3f}); {held} of {total} parameter elements "
                      "on this process")
    state = accelerator.get_state_dict(model)  # every process: the shards are gathered
    if args.output_dir is not None:
        accelerator.unwrap_model(model).save_pretrained(args.output_dir, state_dict=state,
                                                        is_main_process=accelerator.is_main_process,
                                                        save_function=accelerator.save)
    accelerator.wait_for_everyone()
    return {"distributed_type": accelerator.distributed_type.value, "mixed_precision": accelerator.mixed_precision,
            "num_processes": accelerator.num_processes, "held": held, "total": total, "steps": step,
            "first_eval_loss": first_eval, "eval_loss": last_eval}


if __name__ == "__main__":
    main()

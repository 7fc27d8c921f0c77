"""Checkpointing and resume: save_state every --checkpointing_steps optimizer steps, --resume_from_checkpoint picks up where a run stopped, data order included. Launch: accelerate-c launch --num_processes 2 --cpu examples/by_feature/checkpointing.py --checkpointing_steps 20 --output_dir ckpts

A checkpoint holds the model, optimizer, scheduler, RNG states and data loader positions
(safetensors + JSON, written atomically). On resume, load_state restores them and
skip_first_batches skips what the interrupted epoch had already seen."""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import text_task  # noqa: E402

from accelerate_c import Accelerator  # noqa: E402
from accelerate_c.utils import set_seed  # noqa: E402


def main(argv=None) -> dict:
    parser = text_task.add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--checkpointing_steps", type=int, default=20, help="save every N optimizer steps")
    parser.add_argument("--output_dir", default="checkpoints")
    parser.add_argument("--resume_from_checkpoint", default=None, help="a step_N directory written by this script")
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(args.seed)
    model, optimizer, train_dl, eval_dl, scheduler, total = text_task.build(accelerator, args)
    step = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        step = int(re.search(r"step_(\d+)", os.path.basename(os.path.normpath(args.resume_from_checkpoint)))[1])
        accelerator.print(f"resumed from {args.resume_from_checkpoint} at step {step}")
    start_epoch, skip = divmod(step, len(train_dl))
    for epoch in range(start_epoch, args.num_epochs):
        # the first epoch after a resume skips the batches it had already trained on
        loader = accelerator.skip_first_batches(train_dl, skip) if epoch == start_epoch and skip else train_dl
        for batch in loader:
            loss = model(**text_task.batch_dict(batch)).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{step}"))
            if step >= total:
                break
        metrics = text_task.evaluate(accelerator, model, eval_dl)
        accelerator.print(f"epoch {epoch}: {metrics}")
        if step >= total:
            break
    return metrics


if __name__ == "__main__":
    main()

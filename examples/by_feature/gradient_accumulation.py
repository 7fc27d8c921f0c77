"""Gradient accumulation: Accelerator(gradient_accumulation_steps=N) and accelerator.accumulate(model), one optimizer step per N batches. Launch: accelerate-c launch --num_processes 2 --cpu examples/by_feature/gradient_accumulation.py --gradient_accumulation_steps 4

Inside accumulate(), backward divides the loss by N and reduces gradients across processes only
on the N-th batch; optimizer.step() and scheduler.step() do nothing on the others."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import text_task  # noqa: E402

from accelerate_c import Accelerator  # noqa: E402
from accelerate_c.utils import set_seed  # noqa: E402


def main(argv=None) -> dict:
    parser = text_task.add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    model, optimizer, train_dl, eval_dl, scheduler, total = text_task.build(accelerator, args)
    steps = 0
    for epoch in range(args.num_epochs):
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**text_task.batch_dict(batch)).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            steps += accelerator.sync_gradients  # True on the batches that stepped
            if steps >= total:
                break
        metrics = text_task.evaluate(accelerator, model, eval_dl)
        accelerator.print(f"epoch {epoch}: {metrics} after {steps} optimizer steps")
        if steps >= total:
            break
    return metrics


if __name__ == "__main__":
    main()

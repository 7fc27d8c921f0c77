"""Metrics over several processes: gather_for_metrics collects every process's predictions and drops the samples repeated to fill the last batch, so the metric counts each evaluation sample once. Launch: accelerate-c launch --num_processes 2 --cpu examples/by_feature/multi_process_metrics.py --eval_size 401

With 401 samples on 2 processes and batches of 32, the data loader gives each process the same
number of batches by repeating samples at the end; gather() would count them, gather_for_metrics
does not."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import text_task  # noqa: E402

from accelerate_c import Accelerator  # noqa: E402
from accelerate_c.utils import set_seed  # noqa: E402


def main(argv=None) -> dict:
    parser = text_task.add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.set_defaults(eval_size=401)
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(args.seed)
    model, optimizer, train_dl, eval_dl, scheduler, total = text_task.build(accelerator, args)
    for step, batch in enumerate(train_dl):
        if step >= total:
            break
        accelerator.backward(model(**text_task.batch_dict(batch)).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    model.eval()
    seen_gather, seen_for_metrics, correct = 0, 0, 0
    with torch.no_grad():
        for batch in eval_dl:
            preds = model(**text_task.batch_dict(batch)).logits.argmax(-1)
            seen_gather += len(accelerator.gather(preds))  # counts the repeated samples too
            preds, labels = accelerator.gather_for_metrics((preds, batch[2]))
            seen_for_metrics += len(preds)
            correct += int((preds == labels).sum())
    metrics = {"accuracy": correct / seen_for_metrics, "count": seen_for_metrics, "count_with_gather": seen_gather}
    accelerator.print(f"{metrics} (the evaluation set has {args.eval_size} samples)")
    return metrics


if __name__ == "__main__":
    main()

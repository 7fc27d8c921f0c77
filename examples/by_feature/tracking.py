"""Experiment tracking: Accelerator(log_with=..., project_dir=...), init_trackers with the run's configuration, accelerator.log each step, end_training. Launch: accelerate-c launch --num_processes 2 --cpu examples/by_feature/tracking.py --log_with jsonl tensorboard --project_dir runs/tracking

The trackers run on the main process only; the other processes' log calls do nothing. jsonl
needs no package; tensorboard, wandb, mlflow, ... need theirs ("all": every installed one)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import text_task  # noqa: E402

from accelerate_c import Accelerator  # noqa: E402
from accelerate_c.utils import set_seed  # noqa: E402


def main(argv=None) -> dict:
    parser = text_task.add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--log_with", nargs="+", default=["jsonl"], help="tracker names, or all")
    parser.add_argument("--project_dir", default="runs/tracking")
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, log_with=args.log_with,
                              project_dir=args.project_dir)
    set_seed(args.seed)
    model, optimizer, train_dl, eval_dl, scheduler, total = text_task.build(accelerator, args)
    accelerator.init_trackers("tracking_example", config={k: v for k, v in vars(args).items()
                                                          if isinstance(v, (int, float, str, bool))})
    step = 0
    for epoch in range(args.num_epochs):
        for batch in train_dl:
            loss = model(**text_task.batch_dict(batch)).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            # the mean over processes, so the logged number is the whole batch's
            accelerator.log({"train_loss": accelerator.reduce(loss.detach(), "mean").item(),
                             "lr": scheduler.get_last_lr()[0]}, step=step)
            if step >= total:
                break
        metrics = text_task.evaluate(accelerator, model, eval_dl)
        accelerator.log({"eval_accuracy": metrics["accuracy"], "eval_f1": metrics["f1"], "epoch": epoch}, step=step)
        accelerator.print(f"epoch {epoch}: {metrics}")
        if step >= total:
            break
    accelerator.end_training()  # closes the trackers
    return metrics


if __name__ == "__main__":
    main()

"""Early stopping with triggers: any process calls accelerator.set_trigger() when its loss is low enough, and every process leaves the loop at the same step through check_trigger(). Launch: accelerate-c launch --num_processes 2 --cpu examples/by_feature/early_stopping.py --stop_below 0.2

A process that broke out of the loop alone would leave the others waiting in a collective;
check_trigger() is that collective, so all of them see the same answer."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import text_task  # noqa: E402

from accelerate_c import Accelerator  # noqa: E402
from accelerate_c.utils import set_seed  # noqa: E402


def main(argv=None) -> dict:
    parser = text_task.add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--stop_below", type=float, default=0.2, help="stop once a process's loss is below this")
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(args.seed)
    model, optimizer, train_dl, eval_dl, scheduler, total = text_task.build(accelerator, args)
    step, stopped = 0, False
    for epoch in range(args.num_epochs):
        for batch in train_dl:
            loss = model(**text_task.batch_dict(batch)).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if loss.item() < args.stop_below:
                accelerator.set_trigger()  # this process alone decides ...
            if accelerator.check_trigger():  # ... and every process learns it here
                stopped = True
                break
            if step >= total:
                break
        if stopped or step >= total:
            break
    metrics = {**text_task.evaluate(accelerator, model, eval_dl), "stopped_early": stopped, "step": step}
    accelerator.print(f"{'stopped early' if stopped else 'ran to the end'} at step {step}: {metrics}")
    return metrics


if __name__ == "__main__":
    main()

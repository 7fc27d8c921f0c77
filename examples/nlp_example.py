"""Text classification in the shape of accelerate's nlp_example.py: a small BERT from a config, trained from scratch on a generated task, accuracy/F1 gathered across processes. Launch: accelerate-c launch --num_processes 2 --cpu examples/nlp_example.py

The only change from an accelerate script is the import (accelerate -> accelerate_c). The data
and model come from examples/text_task.py; --max_train_steps cuts a run short (the tests)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import text_task  # noqa: E402

from accelerate_c import Accelerator  # noqa: E402
from accelerate_c.utils import set_seed  # noqa: E402


def training_function(args) -> dict:
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(args.seed)
    model, optimizer, train_dl, eval_dl, scheduler, total = text_task.build(accelerator, args)
    step, metrics = 0, {}
    for epoch in range(args.num_epochs):
        model.train()
        for batch in train_dl:
            loss = model(**text_task.batch_dict(batch)).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step >= total:
                break
        # every process evaluates its share; the metrics are computed over the gathered whole
        metrics = text_task.evaluate(accelerator, model, eval_dl)
        accelerator.print(f"epoch {epoch}: {metrics}")
        if step >= total:
            break
    return metrics


def parse_args(argv=None):
    return text_task.add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)


def main(argv=None):
    return training_function(parse_args(argv))


if __name__ == "__main__":
    main()

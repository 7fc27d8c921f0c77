"""ZeRO stage 2: optimizer state and gradients sharded across processes through DeepSpeedPlugin(zero_stage=2), as accelerate takes DeepSpeed, with the engine's gradient clipping. Launch: accelerate-c launch --num_processes 2 --cpu examples/by_feature/zero2.py

Each process keeps the AdamW state and the reduced gradients of its own shard only; after each
step the updated parameters are gathered back. The loop is the plain one: the sharding is in the
plugin (docs/sharding.md)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import text_task  # noqa: E402

from accelerate_c import Accelerator  # noqa: E402
from accelerate_c.utils import DeepSpeedPlugin, set_seed  # noqa: E402


def main(argv=None) -> dict:
    parser = text_task.add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--gradient_clipping", type=float, default=1.0)
    args = parser.parse_args(argv)
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=args.gradient_clipping)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, deepspeed_plugin=plugin)
    set_seed(args.seed)
    model, optimizer, train_dl, eval_dl, scheduler, total = text_task.build(accelerator, args)
    step = 0
    for epoch in range(args.num_epochs):
        for batch in train_dl:
            loss = model(**text_task.batch_dict(batch)).loss
            accelerator.backward(loss)
            optimizer.step()  # the engine clips at gradient_clipping, then steps its shard
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step >= total:
                break
        metrics = text_task.evaluate(accelerator, model, eval_dl)
        accelerator.print(f"epoch {epoch}: {metrics}")
        if step >= total:
            break
    return metrics


if __name__ == "__main__":
    main()

"""A transformers Trainer script on accelerate_c: `from accelerate_c.transformers import Trainer` in place of transformers' (the one line that differs), training a tiny LlamaForCausalLM from a LlamaConfig with evaluation, logging and checkpoints. Launch: accelerate-c launch --num_processes 2 --cpu examples/by_feature/trainer.py (or with --config_file tests/data/fsdp_seed_config.yaml for FSDP, as the tests run it)

The Trainer, its TrainingArguments, callbacks, checkpoints and log history are transformers'
own; only the Accelerator under it is accelerate_c's, built from the same arguments (so the
launcher's config, FSDP included, applies as it does to accelerate's)."""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import llama_task  # noqa: E402

from transformers import TrainingArguments  # noqa: E402

from accelerate_c.transformers import Trainer  # noqa: E402  (was: from transformers import Trainer)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="train on CPU processes (TrainingArguments.use_cpu)")
    parser.add_argument("--output_dir", default="runs/trainer_example")
    parser.add_argument("--train_size", type=int, default=512)
    parser.add_argument("--eval_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=8, help="per process")
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--eval_steps", type=int, default=20)
    parser.add_argument("--save_steps", type=int, default=20)
    # transformers' Trainer reports through its own integration callbacks: their names, not
    # accelerate_c's (no jsonl here)
    parser.add_argument("--report_to", nargs="+", default=["none"], help="transformers integrations: tensorboard, ...")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=1e-2, warmup_steps=2, max_steps=args.max_steps,
        max_grad_norm=1.0, logging_steps=1, eval_strategy="steps", eval_steps=args.eval_steps,
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=1, use_cpu=args.cpu,
        report_to=args.report_to, seed=args.seed, disable_tqdm=True,
        dataloader_pin_memory=not args.cpu)  # pinned memory is for copies to a GPU
    trainer = Trainer(model=llama_task.make_model(args.seed), args=training_args,
                      train_dataset=llama_task.make_samples(args.train_size, seed=1),
                      eval_dataset=llama_task.make_samples(args.eval_size, seed=2))
    result = trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"Trainer on {type(trainer.accelerator).__module__}.{type(trainer.accelerator).__name__} "
              f"({trainer.accelerator.distributed_type.value}, {trainer.accelerator.num_processes} processes): "
              f"{result.global_step} steps, train loss {result.training_loss:.3f}, eval loss "
              f"{metrics['eval_loss']:.3f} (uniform guess: {math.log(llama_task.VOCAB):.3f})")
    return {"accelerator": type(trainer.accelerator).__module__,
            "distributed_type": trainer.accelerator.distributed_type.value,
            "num_processes": trainer.accelerator.num_processes, "global_step": result.global_step,
            "train_loss": result.training_loss, "eval_loss": metrics["eval_loss"],
            "log_history": trainer.state.log_history,
            "checkpoints": sorted(n for n in os.listdir(args.output_dir) if n.startswith("checkpoint-"))}


if __name__ == "__main__":
    main()

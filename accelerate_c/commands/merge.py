"""`accelerate-c merge-weights CHECKPOINT_DIR OUTPUT_DIR`: a checkpoint's model weights in the
Hugging Face layout (model.safetensors, or shards and an index when large), without a process
group. From a checkpoint saved under ZeRO with DeepSpeed's bf16/fp16 policy the fp32 master
weights are assembled from every process's shard (zero_checkpoint.merged_weights); sharded
weights (FSDP's SHARDED_STATE_DICT, DeepSpeed stage 3) from every process's shard of them
(model_shards.merged)."""
from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("merge-weights", help="write a checkpoint's (sharded) weights as Hugging Face safetensors",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint_dir", help="a directory save_state wrote")
    p.add_argument("output_dir", help="where the weights go")
    p.add_argument("--model_index", type=int, default=0, help="which prepared model (default 0)")
    p.add_argument("--max_shard_size", default="10GB", help="largest weights file before sharding (default 10GB)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import model_shards
    from ..model_io import save_model
    from ..zero_checkpoint import merged_weights

    if model_shards.is_sharded(args.checkpoint_dir, args.model_index):  # each process's shards of the weights
        sd = model_shards.merged(args.checkpoint_dir, args.model_index)
    else:
        sd = merged_weights(args.checkpoint_dir, args.model_index)
    files = save_model(sd, args.output_dir, max_shard_size=args.max_shard_size)
    print(f"merge-weights: {len(sd)} tensors from {args.checkpoint_dir} -> {args.output_dir} ({', '.join(files)})")
    return 0

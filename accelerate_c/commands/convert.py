"""`accelerate-c convert-checkpoint DIR --to accelerate [--output OUT]`: a checkpoint written by
accelerate_c's save_state, rewritten with accelerate's own file names and formats so that
accelerate's load_state reads it (checkpoint_convert.py)."""
from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("convert-checkpoint", help="rewrite a checkpoint in accelerate's own save_state layout",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint_dir", help="a directory accelerate_c's save_state wrote")
    p.add_argument("--to", required=True, choices=["accelerate"], help="the layout to write")
    p.add_argument("--output", default=None, help="the new directory (default: CHECKPOINT_DIR_accelerate)")
    p.set_defaults(func=run)


def run(args) -> int:
    import os

    from ..checkpoint_convert import to_accelerate

    output = args.output or os.path.normpath(args.checkpoint_dir) + "_accelerate"
    written, left_out = to_accelerate(args.checkpoint_dir, output)
    print(f"convert-checkpoint: {args.checkpoint_dir} -> {output} (accelerate's layout): {', '.join(written)}")
    if left_out:
        print(f"  not carried (accelerate's layout has no file for them): {', '.join(left_out)}")
    return 0

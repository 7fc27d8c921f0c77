"""`accelerate-c`: entry point that dispatches to the subcommands."""
import argparse
import sys

from . import config, convert, env, estimate, launch, merge, test


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accelerate-c",
        description="accelerate_c command line: accelerate's CLI, backed by a C core.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{config,env,launch,test,estimate-memory,merge-weights,convert-checkpoint}")
    config.register(sub)
    env.register(sub)
    launch.register(sub)
    test.register(sub)
    estimate.register(sub)
    merge.register(sub)
    convert.register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

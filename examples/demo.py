"""make demo: train the GPT-style model on 2 processes, resume its second half from the half-way checkpoint in new processes, check the resumed half is bitwise the same and the held-out loss target is met, and draw the loss curve. Launch: make demo (or python examples/demo.py)

Both runs go through `accelerate-c launch --num_processes 2 --cpu --mixed_precision bf16`
(examples/train_gpt.py: gradient accumulation 2, clipping at 1.0, a checkpoint at the half-way
step). Everything lands under --out (runs/demo/): the trackers' JSON-lines logs and TensorBoard
events of both runs, the checkpoint, and loss_curve.png (training and held-out loss; the resumed
run drawn over the second half, the resume point marked). Exits non-zero when the resumed half
differs from the uninterrupted run in any logged loss or in the final parameters, or when the
held-out loss misses --target-loss."""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(num_processes: int, argv: list) -> int:
    cmd = [sys.executable, "-m", "accelerate_c.commands.main", "launch", "--num_processes", str(num_processes),
           "--cpu", "--mixed_precision", "bf16", "--main_process_port", "0", os.path.join(HERE, "train_gpt.py"),
           *argv]
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    return subprocess.call(cmd, env=env)


def read_log(path: str) -> dict:
    """step -> the values logged at it, from a JSON-lines tracker file."""
    rows = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            rows[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


def plot(full: dict, resumed: dict, resume_at: int, target: float, path: str):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    steps = sorted(full)
    ax.plot(steps, [full[s]["train_loss"] for s in steps], color="tab:blue", lw=1, alpha=0.8,
            label="training loss (uninterrupted run)")
    ev = [s for s in steps if "eval_loss" in full[s]]
    ax.plot(ev, [full[s]["eval_loss"] for s in ev], "o-", color="tab:orange", label="held-out loss")
    rs = sorted(resumed)
    ax.plot(rs, [resumed[s]["train_loss"] for s in rs], "--", color="black", lw=1,
            label="training loss (resumed run, new processes)")
    rev = [s for s in rs if "eval_loss" in resumed[s]]
    ax.plot(rev, [resumed[s]["eval_loss"] for s in rev], "x", color="black", ms=8, label="held-out loss (resumed)")
    ax.axvline(resume_at, color="tab:red", ls=":", label=f"checkpoint / resume (step {resume_at})")
    ax.axhline(target, color="tab:green", ls=":", lw=1, label=f"held-out target {target}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_yscale("log")
    ax.set_title("TinyGPT on 2 processes with accelerate_c (bf16, accumulation 2, clipping)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def verify(out: str, half: int, target: float):
    """Reads both runs' logs and final states: (full log, resumed log, final states, the steps
    whose logged values differ, whether the resumed half is bitwise the same, whether the held-out
    target is reached)."""
    full = read_log(os.path.join(out, "full", "metrics.jsonl"))
    resumed = read_log(os.path.join(out, "resumed", "metrics.jsonl"))
    finals = [json.load(open(os.path.join(out, run, "final.json"))) for run in ("full", "resumed")]
    second_half = {s: full[s] for s in full if s > half}
    differ = [s for s in sorted(set(second_half) | set(resumed)) if resumed.get(s) != second_half.get(s)]
    same = not differ and finals[0]["params_sha256"] == finals[1]["params_sha256"]
    reached = finals[0]["eval_loss"] <= target and finals[1]["eval_loss"] <= target
    return full, resumed, finals, differ, same, reached


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--target-loss", type=float, default=0.5)
    args, rest = ap.parse_known_args(argv)  # the rest goes to train_gpt.py (e.g. --text-chars for a short run)
    half = args.steps // 2
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)  # a fresh run: the logs are appended to, the checkpoint replaced
    common = ["--steps", str(args.steps), "--out", args.out, "--target-loss", str(args.target_loss), *rest]
    start = time.time()
    print(f"== 1/2: {args.steps} steps on {args.num_processes} processes, checkpoint after step {half}", flush=True)
    rc_full = launch(args.num_processes, common + ["--run-name", "full", "--save-at", str(half)])
    checkpoint = os.path.join(args.out, "checkpoint")
    if not os.path.isdir(checkpoint):
        print(f"demo: FAILED: the first run wrote no checkpoint (exit code {rc_full})")
        return 1
    print(f"== 2/2: resume from {checkpoint} in new processes, steps {half + 1}-{args.steps}", flush=True)
    rc_resumed = launch(args.num_processes, common + ["--run-name", "resumed", "--resume", checkpoint])

    full, resumed, finals, differ, same, reached = verify(args.out, half, args.target_loss)
    png = os.path.join(args.out, "loss_curve.png")
    plot(full, resumed, half, args.target_loss, png)

    print(f"\nresumed half (steps {half + 1}-{args.steps}, {len(resumed)} logged steps): "
          + ("bitwise the same as the uninterrupted run (every logged loss and the final parameters' sha256 "
             f"{finals[0]['params_sha256'][:16]}...)" if same else
             f"DIFFERS (first at step {differ[0] if differ else '-'}; parameters "
             f"{'equal' if finals[0]['params_sha256'] == finals[1]['params_sha256'] else 'differ'})"))
    print(f"held-out loss {finals[0]['eval_loss']:.4f} nats/char (target <= {args.target_loss}): "
          f"{'reached' if reached else 'NOT reached'}; {time.time() - start:.0f}s in all")
    print("files:")
    for pattern in ("full/metrics.jsonl", "resumed/metrics.jsonl", "full/events.out.tfevents.*",
                    "resumed/events.out.tfevents.*", "loss_curve.png", "checkpoint"):
        for path in sorted(glob.glob(os.path.join(args.out, pattern))):
            print(f"  {path}")
    print(f"  (tensorboard --logdir {args.out} shows the events)")
    return 0 if same and reached and rc_full == 0 and rc_resumed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

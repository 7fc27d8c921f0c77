"""Long runs of the Python fuzz targets (tests/pyfuzz.py; docs/security.md), one target at a time.

    python tests/fuzz/run_py.py --target load_state --seconds 1200       # hypothesis, new seeds
    python tests/fuzz/run_py.py --target zero_load_state --seconds 1200  # sharded checkpoints (ZeRO, FSDP)
    python tests/fuzz/run_py.py --target config_bytes --engine atheris --seconds 1200
    make fuzz-py FUZZ_PY_SECONDS=1200 FUZZ_PY_TARGETS="config deepspeed"

hypothesis engine: the targets' strategies in batches of new random examples until the time is
up (derandomize off, no example database), a failing example shrunk and printed, exit 1.
atheris engine (requirements-fuzz.txt; coverage guided over accelerate_c's modules): the byte
targets only: config_bytes (YAML or JSON config file text), deepspeed_bytes (DeepSpeed JSON text),
training_args_bytes (a TrainingArguments JSON file). Each run appends one line to
tests/c/bin/fuzz/runs.log (examples, seconds) for the totals in docs/security.md.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)
sys.path.insert(0, ROOT)

HYPOTHESIS_TARGETS = ("config", "config_bytes", "deepspeed", "training_args", "load_state", "model_index",
                      "zero_load_state")
ATHERIS_TARGETS = ("config_bytes", "deepspeed_bytes", "training_args_bytes")


def _log(target: str, engine: str, examples: int, secs: float, rc: int) -> None:
    os.makedirs(os.path.join(TESTS, "c", "bin", "fuzz"), exist_ok=True)
    with open(os.path.join(TESTS, "c", "bin", "fuzz", "runs.log"), "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} py:{target} {engine} {examples} examples "
                f"{secs:.0f} s rc={rc}\n")


def run_hypothesis(target: str, seconds: float) -> int:
    from hypothesis import HealthCheck, given, settings, strategies as st

    import pyfuzz

    tmp = tempfile.mkdtemp(prefix="ac_pyfuzz_")
    atexit.register(shutil.rmtree, tmp, True)
    batch = settings(max_examples=200, deadline=None, database=None, derandomize=False,
                     suppress_health_check=list(HealthCheck))
    if target == "config":
        fn = given(doc=pyfuzz.config_docs(), fmt=st.sampled_from(["yaml", "json"]))(
            lambda doc, fmt: pyfuzz.check_config(doc, fmt, tmp))
    elif target == "config_bytes":
        fn = given(raw=st.binary(max_size=400) | st.text(max_size=400).map(str.encode),
                   fmt=st.sampled_from(["yaml", "json"]))(lambda raw, fmt: pyfuzz.check_config_bytes(raw, fmt, tmp))
    elif target == "deepspeed":
        fn = given(doc=pyfuzz.deepspeed_docs(), mp=st.sampled_from(["no", "fp16", "bf16"]),
                   n=st.sampled_from([1, 2, 3, 8]))(
            lambda doc, mp, n: pyfuzz.check_deepspeed(doc, tmp, mixed_precision=mp, num_processes=n))
    elif target == "training_args":
        fn = given(doc=pyfuzz.training_args_docs())(pyfuzz.check_training_args)
    elif target == "load_state":
        fn = given(ops=pyfuzz.mutations())(pyfuzz.check_load_state)
    elif target == "model_index":
        fn = given(mut=pyfuzz.index_mutations())(pyfuzz.check_model_index)
    elif target == "zero_load_state":
        import pyfuzz_zero

        fn = given(case=pyfuzz_zero.zero_mutations())(pyfuzz_zero.check_zero_load_state)
    else:
        raise SystemExit(f"unknown hypothesis target {target!r} (have: {', '.join(HYPOTHESIS_TARGETS)})")
    fn = batch(fn)
    if target == "zero_load_state":  # the fixtures (a launched 2-process save) before the clock starts
        for kind in pyfuzz_zero.KINDS:
            pyfuzz_zero.kind_bench(kind)
    t0 = time.time()
    rc = 0
    key = {"config_bytes": "config_bytes"}.get(target, target)
    try:
        while time.time() - t0 < seconds:
            fn()
    except Exception as e:  # noqa: BLE001 - hypothesis raised the shrunk failure
        import traceback

        traceback.print_exc()  # the shrunk input is in it ("Falsifying example")
        print(f"FINDING in {target}: {e}", file=sys.stderr)
        rc = 1
    n = pyfuzz.COUNTS.get(key, 0)
    _log(target, "hypothesis", n, time.time() - t0, rc)
    print(f"{target}: {n} examples in {time.time() - t0:.0f} s, {'a finding (above)' if rc else 'no finding'}")
    return rc


def run_atheris(target: str, seconds: float) -> int:
    import atheris

    with atheris.instrument_imports(include=["accelerate_c", "yaml"]):
        import yaml  # noqa: F401  (the YAML reader is pure Python: its branches guide the mutations)
        import pyfuzz  # noqa: F401
        from accelerate_c.deepspeed_config import plugin  # noqa: F401
        from accelerate_c.deepspeed_config import sharding  # noqa: F401
        from accelerate_c.utils import config  # noqa: F401
        from accelerate_c import training_args  # noqa: F401
    import json

    tmp = tempfile.mkdtemp(prefix="ac_pyfuzz_")
    t0 = time.time()
    state = {"n": 0}

    def one(data: bytes):
        state["n"] += 1
        # libFuzzer ends the process with exit() at -max_total_time, past Python's atexit: log just before
        if not state.get("logged") and time.time() - t0 >= seconds - 1:
            state["logged"] = True
            _log(target, "atheris", state["n"], time.time() - t0, 0)
        if not data:
            return
        fmt = "json" if data[0] & 1 else "yaml"
        body = data[1:]
        if target == "config_bytes":
            pyfuzz.check_config_bytes(body, fmt, tmp)
        elif target == "deepspeed_bytes":
            try:
                doc = json.loads(body.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                return
            pyfuzz.check_deepspeed(doc, tmp)
        elif target == "training_args_bytes":
            path = os.path.join(tmp, "args.json")
            with open(path, "wb") as f:
                f.write(body)
            from accelerate_c.training_args import TrainingArguments

            try:
                TrainingArguments.from_json_file(path)
            except ValueError as e:
                assert "TrainingArguments" in str(e), f"ValueError without the field: {e}"
        else:
            raise SystemExit(f"unknown atheris target {target!r} (have: {', '.join(ATHERIS_TARGETS)})")

    atheris.Setup([sys.argv[0], f"-max_total_time={int(seconds)}", "-max_len=2048", "-rss_limit_mb=4096",
                   f"-artifact_prefix={tmp}/"], one)
    atheris.Fuzz()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--engine", choices=("hypothesis", "atheris"), default="hypothesis")
    a = ap.parse_args()
    if a.engine == "atheris":
        return run_atheris(a.target, a.seconds)
    return run_hypothesis(a.target, a.seconds)


if __name__ == "__main__":
    sys.exit(main())

"""Short, derandomized runs of the Python fuzz targets (tests/pyfuzz.py; docs/security.md): config
files, DeepSpeed JSON, TrainingArguments dicts, load_state on mutated checkpoint directories and
the model index reader (load_model_weights); load_state in one process of sharded checkpoints
(ZeRO-1, -2, -3, full sharding) that a launched 2-process job wrote (tests/pyfuzz_zero.py).
Each case must be taken or refused with an error naming the file or key; a failed load must leave
the job as it was. The long runs: python tests/fuzz/run_py.py (make fuzz-py)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pyfuzz
import pyfuzz_zero
from helpers import fresh_state  # noqa: F401

SHORT = settings(max_examples=300, derandomize=True, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))


@SHORT
@given(doc=pyfuzz.config_docs(), fmt=st.sampled_from(["yaml", "json"]))
def test_config_files(tmp_path_factory, doc, fmt):
    pyfuzz.check_config(doc, fmt, str(tmp_path_factory.mktemp("cfg")))


@SHORT
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode), fmt=st.sampled_from(["yaml", "json"]))
def test_config_bytes(tmp_path_factory, raw, fmt):
    pyfuzz.check_config_bytes(raw, fmt, str(tmp_path_factory.mktemp("cfgb")))


@SHORT
@given(doc=pyfuzz.deepspeed_docs(), mp=st.sampled_from(["no", "fp16", "bf16"]), n=st.sampled_from([1, 2, 3]))
def test_deepspeed_json(tmp_path_factory, doc, mp, n):
    pyfuzz.check_deepspeed(doc, str(tmp_path_factory.mktemp("ds")), mixed_precision=mp, num_processes=n)


@SHORT
@given(doc=pyfuzz.training_args_docs())
def test_training_args_dicts(doc):
    pyfuzz.check_training_args(doc)


@settings(SHORT, max_examples=150)
@given(ops=pyfuzz.mutations())
def test_load_state_on_mutated_checkpoints(fresh_state, ops):  # noqa: F811
    pyfuzz.check_load_state(ops)


@SHORT
@given(mut=pyfuzz.index_mutations())
def test_model_index_and_shards(mut):
    pyfuzz.check_model_index(mut)


@settings(SHORT, max_examples=100)
@given(case=pyfuzz_zero.zero_mutations())
def test_load_state_on_mutated_sharded_checkpoints(fresh_state, case):  # noqa: F811
    pyfuzz_zero.check_zero_load_state(case)

"""Experiment trackers on one process: what each built-in tracker writes is read back by an
independent reader (json for JSON-lines, tbparse for TensorBoard, wandb's record format for
its offline files) and compared with the values logged and with what accelerate 1.15's own
trackers write for the same calls in the same test. The multi-process side (main process
only) is in test_around_loop_processes.py."""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import struct
import time

import accelerate
import accelerate.tracking as acc_tracking
import pytest
import torch
import yaml

import accelerate_c
from accelerate_c.tracking import GeneralTracker, JSONLTracker, register_tracker_class
from helpers import fresh_state  # noqa: F401  (autouse: fresh singletons per test)
from timeouts import wait_s

CONFIG = {"learning_rate": 0.003, "batch_size": 16, "optimizer": "adamw", "bf16": True}
LOGS = [  # (values, step): numbers, a string, a dict of numbers, 0-dim tensors
    ({"loss": 2.5, "lr": 0.001, "epoch": 0}, 1),
    ({"loss": torch.tensor(1.75), "accuracy": torch.tensor(0.5, dtype=torch.bfloat16)}, 2),
    ({"note": "half-way", "loss": 1.25}, 3),
    ({"losses": {"train": 1.0, "eval": 1.5}}, 4),
]


def _ours(tmp_path, log_with, **kw):
    return accelerate_c.Accelerator(cpu=True, log_with=log_with, project_dir=str(tmp_path / "ours"), **kw)


def _theirs(tmp_path, log_with):
    return accelerate.Accelerator(cpu=True, log_with=log_with, project_dir=str(tmp_path / "theirs"))


def _run(acc, project="run", config=CONFIG, logs=LOGS, init_kwargs=None):
    acc.init_trackers(project, config=config, init_kwargs=init_kwargs)
    for values, step in logs:
        acc.log(values, step=step)
    acc.end_training()


def _number(v):
    return float(v.float().item()) if isinstance(v, torch.Tensor) else v


# ---- JSON lines ---------------------------------------------------------------------------

def test_jsonl_tracker_writes_every_call_as_json_reads_it(tmp_path):
    acc = _ours(tmp_path, "jsonl")
    _run(acc)
    run_dir = tmp_path / "ours" / "run"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["_step"] for line in lines] == [step for _, step in LOGS]
    for line, (values, _) in zip(lines, LOGS):
        assert isinstance(line.pop("_timestamp"), float)
        line.pop("_step")
        assert line == {k: _number(v) for k, v in values.items()}
    assert json.loads((run_dir / "config.json").read_text()) == CONFIG
    # a resumed run (a new Accelerator, same project) appends to the same file
    acc = _ours(tmp_path, "jsonl")
    _run(acc, logs=[({"loss": 0.5}, 5)])
    steps = [json.loads(line)["_step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_jsonl_tracker_refuses_what_json_cannot_hold_naming_the_key(tmp_path):
    acc = _ours(tmp_path, "jsonl")
    acc.init_trackers("run")
    with pytest.raises(TypeError, match="'weights'"):
        acc.log({"weights": object()})
    with pytest.raises(ValueError, match="'_step'"):
        acc.log({"_step": 3})
    with pytest.raises(TypeError, match=r"log_kwargs\['jsonl'\]"):
        acc.log({"loss": 1.0}, log_kwargs={"jsonl": {"commit": True}})
    acc.log({"nan": math.nan, "vector": torch.arange(3)}, step=7)  # Python's json writes and reads NaN
    acc.end_training()
    (line,) = [json.loads(x) for x in (tmp_path / "ours" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert math.isnan(line["nan"]) and line["vector"] == [0, 1, 2] and line["_step"] == 7


# ---- TensorBoard ---------------------------------------------------------------------------

def _tb_frames(root):
    """tbparse's view of an event directory, with the time-named hparams directory made
    comparable (its name is time.time() in both accelerate and accelerate_c)."""
    from tbparse import SummaryReader

    reader = SummaryReader(str(root), extra_columns={"dir_name"})
    frames = {}
    for kind in ("scalars", "text", "hparams"):
        df = reader.__getattribute__(kind).copy()
        df["dir_name"] = df["dir_name"].map(lambda d: "run/<time>" if d.count("/") and d.split("/")[1][0].isdigit()
                                            else d)
        frames[kind] = df.sort_values(list(df.columns)).reset_index(drop=True)
    return frames


def test_tensorboard_tracker_writes_what_accelerate_writes(tmp_path):
    pytest.importorskip("tbparse")
    _run(_ours(tmp_path, "tensorboard"))
    _run(_theirs(tmp_path, "tensorboard"))
    ours, theirs = _tb_frames(tmp_path / "ours"), _tb_frames(tmp_path / "theirs")
    for kind in ours:
        assert ours[kind].equals(theirs[kind]), f"{kind}:\n{ours[kind]}\naccelerate:\n{theirs[kind]}"
    # and what was logged is what is read: every number at its step
    scalars = ours["scalars"]
    got = {(r.step, r.tag if r.dir_name == "run" else f"{r.tag}/{r.dir_name.split('_')[-1]}"): r.value
           for r in scalars.itertuples()}
    want = {}
    for values, step in LOGS:
        for k, v in values.items():
            if isinstance(v, dict):
                want.update({(step, f"{k}/{kk}"): vv for kk, vv in v.items()})
            elif not isinstance(v, str):
                want[(step, k)] = _number(v)
    assert got.keys() == want.keys() and all(math.isclose(got[k], want[k], rel_tol=1e-6) for k in want)
    assert list(ours["text"]["value"]) == ["half-way"]
    (ours_yml,) = glob.glob(str(tmp_path / "ours" / "run" / "*" / "hparams.yml"))
    (theirs_yml,) = glob.glob(str(tmp_path / "theirs" / "run" / "*" / "hparams.yml"))
    assert yaml.safe_load(open(ours_yml)) == yaml.safe_load(open(theirs_yml)) == CONFIG


# ---- wandb (offline) ------------------------------------------------------------------------

def _wandb_records(path):
    """The protobuf records of a wandb transaction log (.wandb): a 7-byte file header, then
    LevelDB-log style chunks (crc32, length, type: full / first / middle / last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            pending = chunk
        elif kind == 2:
            pending = chunk
            continue
        elif kind == 3:
            pending += chunk
            continue
        elif kind == 4:
            pending += chunk
        else:
            break
        rec = pb.Record()
        rec.ParseFromString(pending)
        records.append(rec)
    return records


def _wait_for_wandb_exit(root):
    """wandb's service may still be writing the offline run's file when finish() returns (seen
    on a loaded machine: the file read back before its records were in): wait for its exit
    record, a hang past the limit failing the test."""
    deadline = time.monotonic() + wait_s(20)
    while True:
        logs = glob.glob(os.path.join(root, "wandb", "offline-run-*", "run-*.wandb"))
        if len(logs) == 1 and any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(logs[0])):
            return
        assert time.monotonic() < deadline, f"no exit record in wandb's offline run under {root}: {logs}"
        time.sleep(0.2)


def _wandb_run(root):
    """(history rows {key: value} by step, config {key: value}) of the one offline run under root."""
    (log,) = glob.glob(os.path.join(root, "wandb", "offline-run-*", "run-*.wandb"))
    history, config = {}, {}
    for rec in _wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            step = row.pop("_step")
            row = {k: v for k, v in row.items() if not k.startswith("_")}  # _runtime, _timestamp
            history[step] = row
        elif kind == "config":
            for item in rec.config.update:
                if not item.key.startswith("_"):
                    config[item.key] = json.loads(item.value_json)
    return history, config


def test_wandb_tracker_writes_what_accelerate_writes_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):  # not shared with another worker
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    logs = [({k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}, step) for values, step in LOGS]
    for who, make in (("ours", _ours), ("theirs", _theirs)):
        (tmp_path / who).mkdir()
        # wandb keeps its settings for the process: the directory goes to each run's init
        _run(make(tmp_path, "wandb"), logs=logs, init_kwargs={"wandb": {"dir": str(tmp_path / who)}})
        _wait_for_wandb_exit(tmp_path / who)
    ours, theirs = _wandb_run(tmp_path / "ours"), _wandb_run(tmp_path / "theirs")
    assert ours == theirs
    history, config = ours
    assert config == CONFIG
    assert sorted(history) == [step for _, step in logs]
    assert history[1] == {"loss": 2.5, "lr": 0.001, "epoch": 0} and history[3]["note"] == "half-way"


# ---- choosing trackers --------------------------------------------------------------------

NOT_INSTALLED = [n for n in ("comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio")
                 if importlib.util.find_spec(n) is None]


@pytest.mark.parametrize("name", NOT_INSTALLED)
def test_a_missing_package_is_an_error_naming_it(name):
    # accelerate drops the tracker with a debug message; ours refuses at the constructor
    assert accelerate.Accelerator(cpu=True, log_with=name).log_with == []
    with pytest.raises(ImportError, match=f"`{name}` package, which is not installed"):
        accelerate_c.Accelerator(cpu=True, log_with=name)


def test_all_picks_every_installed_tracker_as_accelerate_does_plus_jsonl(tmp_path):
    theirs = [str(t) for t in acc_tracking.get_available_trackers()]
    ours = _ours(tmp_path, "all")
    assert sorted(str(t) for t in ours.log_with) == sorted(theirs + ["jsonl"])
    with pytest.raises(ValueError, match="jsonl.*logging directory"):
        accelerate_c.Accelerator(cpu=True, log_with="all")


@pytest.mark.parametrize("log_with,error,match", [
    ("tensorbord", ValueError, "unknown tracker"),
    (["jsonl", 3], ValueError, "log_with=3"),
    ("jsonl", ValueError, "jsonl write under a logging directory"),
])
def test_bad_log_with_is_refused_naming_it(log_with, error, match):
    with pytest.raises(error, match=match):
        accelerate_c.Accelerator(cpu=True, log_with=log_with)


def test_misspelt_init_kwargs_key_is_refused(tmp_path):
    acc = _ours(tmp_path, "jsonl")
    with pytest.raises(ValueError, match="'jsnol'"):
        acc.init_trackers("run", init_kwargs={"jsnol": {}})
    acc.init_trackers("run", init_kwargs={"jsonl": {"filename": "m.jsonl"}, "wandb": {"tags": ["x"]}})
    assert acc.get_tracker("jsonl").path.endswith("m.jsonl")
    acc.end_training()


# ---- the user's own trackers --------------------------------------------------------------

def _recording(base):
    class Recording(base):
        name = "recording"
        requires_logging_directory = False

        def __init__(self, calls):
            super().__init__()
            self.calls = calls

        @property
        def tracker(self):
            return self.calls

        def start(self):
            self.calls.append(("start",))

        def store_init_configuration(self, values):
            self.calls.append(("config", dict(values)))

        def log(self, values, step=None, **kwargs):
            self.calls.append(("log", {k: _number(v) for k, v in values.items()}, step, kwargs))

        def finish(self):
            self.calls.append(("finish",))

    return Recording


@pytest.mark.parametrize("base", ["ours", "accelerate's"])
def test_user_trackers_get_the_calls_accelerate_makes(base, tmp_path):
    # accelerate takes only its own base class; ours takes both
    ours_cls = _recording(GeneralTracker if base == "ours" else acc_tracking.GeneralTracker)
    theirs_cls = _recording(acc_tracking.GeneralTracker)
    ours_calls, theirs_calls = [], []
    logs = LOGS[:2]
    for make, cls, calls in ((_ours, ours_cls, ours_calls), (_theirs, theirs_cls, theirs_calls)):
        acc = make(tmp_path, [cls(calls), "jsonl" if make is _ours else "tensorboard"])
        acc.init_trackers("run", config=CONFIG)
        assert acc.get_tracker("recording") is acc.trackers[0]
        assert acc.get_tracker("recording", unwrap=True) is calls
        for values, step in logs:
            acc.log(values, step=step, log_kwargs={"recording": {"commit": True}})
        acc.end_training()
    assert ours_calls == theirs_calls
    assert ours_calls[0] == ("start",) and ours_calls[-1] == ("finish",)


def test_a_registered_tracker_class_is_taken_by_name(tmp_path):
    calls = []

    class ByName(_recording(GeneralTracker)):
        name = "by_name"

        def __init__(self, run_name, **kwargs):
            super().__init__(calls)
            calls.append(("init", run_name, kwargs))

    register_tracker_class(ByName)
    try:
        acc = accelerate_c.Accelerator(cpu=True, log_with="by_name")
        acc.init_trackers("proj", init_kwargs={"by_name": {"x": 1}})
        acc.log({"a": 1.0}, step=1)
        acc.end_training()
    finally:
        from accelerate_c.tracking import LOGGER_TYPE_TO_CLASS

        LOGGER_TYPE_TO_CLASS.pop("by_name")
    assert calls == [("init", "proj", {"x": 1}), ("start",), ("log", {"a": 1.0}, 1, {}), ("finish",)]
    with pytest.raises(ValueError, match="subclass of GeneralTracker"):
        register_tracker_class(dict)


def test_a_tracker_missing_its_attributes_is_refused_as_accelerate_does():
    class NoName(GeneralTracker):
        requires_logging_directory = False

    class TheirNoName(acc_tracking.GeneralTracker):
        requires_logging_directory = False

    with pytest.raises(NotImplementedError, match="`name`.*`tracker`"):
        TheirNoName()
    with pytest.raises(NotImplementedError, match="`name`.*`tracker`"):
        NoName()
    assert isinstance(JSONLTracker("r", "d"), GeneralTracker)


# ---- TrainingArguments.report_to ------------------------------------------------------------

def test_trainer_report_to_logs_every_log_entry_to_the_trackers(tmp_path):
    """report_to=["jsonl", "tensorboard"]: each entry of the Trainer's log_history (losses,
    learning rates, eval metrics, the train summary) reaches both trackers at its step, under
    <logging_dir>/<run_name>, and the run's arguments are its configuration."""
    import sys

    from tbparse import SummaryReader

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
    import trainer_common as tc

    args = tc.train_args(str(tmp_path / "out"), max_steps=6, logging_steps=2, eval_strategy="steps", eval_steps=3,
                         report_to=["jsonl", "tensorboard"], run_name="tiny")
    trainer = accelerate_c.Trainer(tc.make_model(), args, train_dataset=tc.make_data(),
                                   eval_dataset=tc.make_data(tc.N_EVAL, seed=2), compute_loss_func=tc.mse)
    trainer.train()
    assert trainer.accelerator.trackers == []  # closed at the end of train()
    run_dir = os.path.join(args.logging_dir, "tiny")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    want = [dict(e) for e in trainer.state.log_history]
    for row, entry in zip(rows, want, strict=True):
        assert row["_step"] == entry.pop("step")
        assert {k: v for k, v in row.items() if not k.startswith("_")} == entry
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert config["learning_rate"] == args.learning_rate and config["max_steps"] == 6
    scalars = SummaryReader(run_dir).scalars
    tb_loss = {r.step: r.value for r in scalars[scalars.tag == "loss"].itertuples()}
    assert tb_loss == pytest.approx({e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e})
    assert sorted(tb_loss) == [2, 4, 6]


# ---- get_logger on one process ------------------------------------------------------------

def test_get_logger_needs_a_state_and_prefixes_the_rank_as_accelerate(caplog, monkeypatch):
    from accelerate.logging import get_logger as theirs

    from accelerate_c.logging import get_logger as ours

    with pytest.raises(RuntimeError, match="PartialState"):
        ours("t_ours").info("before any state")
    with pytest.raises(RuntimeError, match="PartialState"):
        theirs("t_theirs").info("before any state")
    accelerate_c.PartialState(), accelerate.PartialState()
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "debug")
    with caplog.at_level("DEBUG"):
        for name, make in (("t_ours", ours), ("t_theirs", theirs)):
            logger = make(name)
            logger.debug("d %s", 1)
            logger.info("i", main_process_only=False)
            logger.info("o", in_order=True)
    got = {(r.name, r.levelname, r.getMessage(), r.funcName) for r in caplog.records}
    for level, msg in (("DEBUG", "[RANK 0] d 1"), ("INFO", "[RANK 0] i"), ("INFO", "[RANK 0] o")):
        func = "test_get_logger_needs_a_state_and_prefixes_the_rank_as_accelerate"  # the caller's frame
        assert ("t_ours", level, msg, func) in got and ("t_theirs", level, msg, func) in got

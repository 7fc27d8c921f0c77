"""The package adapters that install cheaply here (requirements-dev.txt: mlflow-skinny, clearml),
each run locally (MLflow's file store, ClearML's offline session) by accelerate_c and by
accelerate 1.15 in the same test, with the same calls, and what each wrote read back: MLflow's
through its own MlflowClient, ClearML's from the offline session files it writes for its own
import_offline_session. Plus what the trackers do with log_images / log_table, against
accelerate's trackers. wandb and TensorBoard's scalars are in test_tracking.py; the adapters
whose packages are not installed are tested there for their missing-package error."""
from __future__ import annotations

import contextlib
import glob
import io
import json
import os

import accelerate
import numpy as np
import pytest

import accelerate_c
from helpers import fresh_state  # noqa: F401  (autouse: fresh singletons per test)

CONFIG = {"learning_rate": 0.003, "batch_size": 16, "optimizer": "adamw"}
# numbers at steps, a string (not a metric for either package), eval_/train_ prefixes (ClearML
# series), and a value logged without a step
LOGS = [({"train_loss": 2.5, "eval_loss": 3.0, "lr": 0.001}, 1), ({"train_loss": 1.75, "note": "half-way"}, 2),
        ({"train_loss": 1.25, "eval_accuracy": 0.5}, 3), ({"final_score": 0.75}, None)]
MAKERS = {"ours": accelerate_c.Accelerator, "theirs": accelerate.Accelerator}


def _run(who, log_with, project_dir, project, init_kwargs=None, after=None):
    acc = MAKERS[who](cpu=True, log_with=log_with, project_dir=str(project_dir))
    acc.init_trackers(project, config=CONFIG, init_kwargs=init_kwargs)
    for values, step in LOGS:
        acc.log(values, step=step)
    if after is not None:
        after(acc)
    acc.end_training()


# ---- MLflow (local file store) -----------------------------------------------------------------

def test_mlflow_tracker_logs_what_accelerates_logs_read_by_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database; skinny has none
    for who in MAKERS:
        with pytest.warns(UserWarning, match="'note'") if who == "ours" else contextlib.nullcontext():
            _run(who, "mlflow", tmp_path / who, f"exp_{who}")
    client = MlflowClient()
    seen = {}
    for who in MAKERS:
        (run,) = client.search_runs([client.get_experiment_by_name(f"exp_{who}").experiment_id])
        history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                   for key in run.data.metrics}
        seen[who] = (run.data.params, history, run.info.status)
    assert seen["ours"] == seen["theirs"]
    params, history, status = seen["ours"]
    assert params == {k: str(v) for k, v in CONFIG.items()} and status == "FINISHED"
    # every number at its step (MLflow records a step-less value at step 0); the string is not a metric
    want = {}
    for values, step in LOGS:
        for key, value in values.items():
            if not isinstance(value, str):
                want.setdefault(key, []).append((step or 0, value))
    assert {k: sorted(v) for k, v in history.items()} == want


# ---- ClearML (offline session) ---------------------------------------------------------------

@pytest.fixture
def clearml_offline(tmp_path, monkeypatch):
    """ClearML in offline mode with its sessions under tmp_path; its reports written in this
    process (its default subprocess reporter takes ~10 s to stop)."""
    pytest.importorskip("clearml")
    from clearml import Task

    conf = tmp_path / "clearml.conf"
    conf.write_text("sdk { development { report_use_subprocess: false } }\n")
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(conf))
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "clearml_cache"))
    # left on for the rest of the process: set_offline(False) connects to a server, and no
    # test here wants one
    Task.set_offline(offline_mode=True)
    return {"clearml": {"auto_resource_monitoring": False, "auto_connect_frameworks": False,
                        "auto_connect_streams": False, "auto_connect_arg_parser": False}}


def _clearml_session(folder):
    """What a finished offline session holds: (events without their time, task id and file
    names (an image's name counts the images of the process), the task's stored configuration,
    its name, the bytes of the image files it wrote)."""
    events = json.load(open(os.path.join(folder, "metrics.jsonl")))
    for event in events:
        for key in ("timestamp", "task", "key", "url"):
            event.pop(key, None)
    task = json.load(open(os.path.join(folder, "task.json")))
    images = [open(p, "rb").read() for p in sorted(glob.glob(os.path.join(folder, "data", "**", "*.jpeg"),
                                                             recursive=True))]
    return events, task["configuration"], task["name"], images


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # clearml's own use of pyparsing
def test_clearml_tracker_reports_what_accelerates_reports_offline(tmp_path, clearml_offline):
    image = (np.arange(4 * 5 * 3).reshape(4, 5, 3) * 4).astype(np.uint8)
    sessions = {}
    for who in MAKERS:
        holder = {}

        def extras(acc, holder=holder):
            tracker = acc.get_tracker("clearml")
            tracker.log_images({"eval_sample": image}, step=3)
            tracker.log_table("eval_predictions", columns=["text", "label"], data=[["a b", 1], ["c", 0]], step=3)
            holder["folder"] = tracker.tracker.get_offline_mode_folder()

        # the string is not a scalar: ours warns naming it (accelerate logs a warning)
        with pytest.warns(UserWarning, match="'note'") if who == "ours" else contextlib.nullcontext():
            _run(who, "clearml", tmp_path / who, "proj", init_kwargs=clearml_offline, after=extras)
        sessions[who] = _clearml_session(holder["folder"])
    assert sessions["ours"] == sessions["theirs"]
    events, configuration, name, images = sessions["ours"]
    assert name == "proj"
    scalars = {(e["iter"], e["metric"], e["variant"]): e["value"] for e in events
               if e["type"] == "training_stats_scalar"}
    assert scalars == {(1, "loss", "train"): 2.5, (1, "loss", "eval"): 3.0, (1, "lr", "train"): 0.001,
                       (2, "loss", "train"): 1.75, (3, "loss", "train"): 1.25, (3, "accuracy", "eval"): 0.5,
                       (-2**31, "Summary", "final_score"): 0.75}  # no step: ClearML's single value
    kinds = sorted(e["type"] for e in events if e["type"] != "training_stats_scalar")
    assert kinds == ["plot", "training_debug_image"]  # the table and the image
    assert len(images) == 1 and images[0][:2] == b"\xff\xd8"  # a JPEG
    assert "learning_rate = 0.003" in json.dumps(configuration)


# ---- log_images / log_table on the built-in trackers -------------------------------------------

def test_tensorboard_log_images_as_accelerate_and_no_log_table(tmp_path):
    """TensorBoard's log_images is SummaryWriter.add_images (a batch, NCHW by default, or
    dataformats=...), read back by tensorboard's own EventAccumulator (tbparse's images need
    tensorflow) and decoded by Pillow: the same PNGs as accelerate's; neither has log_table, and
    the JSON-lines tracker, like accelerate's GeneralTracker, has neither."""
    pytest.importorskip("tensorboard")
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    batch = np.stack([np.full((3, 4, 6), v, dtype=np.float32) for v in (0.0, 0.5, 1.0)])  # NCHW
    hwc = (np.arange(4 * 6 * 3).reshape(1, 4, 6, 3) % 255).astype(np.uint8)
    frames = {}
    for who in MAKERS:
        acc = MAKERS[who](cpu=True, log_with=["tensorboard"], project_dir=str(tmp_path / who))
        acc.init_trackers("run")
        tracker = acc.get_tracker("tensorboard")
        tracker.log_images({"samples": batch}, step=1)
        tracker.log_images({"hwc": hwc}, step=2, dataformats="NHWC")
        assert not hasattr(tracker, "log_table")
        acc.end_training()
        events = EventAccumulator(str(tmp_path / who / "run"), size_guidance={IMAGES: 0}).Reload()
        frames[who] = {(tag, e.step): e.encoded_image_string for tag in events.Tags()[IMAGES]
                       for e in events.Images(tag)}
    assert frames["ours"] == frames["theirs"]
    assert frames["ours"].keys() == {("samples", 1), ("hwc", 2)}
    decoded = {key: np.asarray(Image.open(io.BytesIO(png))) for key, png in frames["ours"].items()}
    # add_images tiles the batch into one picture: the three grey levels side by side
    tiled = decoded[("samples", 1)]
    # (floats x 255, cut to uint8 as SummaryWriter converts them)
    assert tiled.shape[:2] == (4, 18) and tiled[0, ::6, 0].tolist() == [int(v * 255) for v in (0.0, 0.5, 1.0)]
    assert np.array_equal(decoded[("hwc", 2)], hwc[0])
    assert not hasattr(accelerate_c.tracking.JSONLTracker, "log_images")
    assert not hasattr(accelerate.tracking.GeneralTracker, "log_images")
    assert not hasattr(accelerate_c.tracking.GeneralTracker, "log_images")


def test_wandb_log_images_and_log_table_as_accelerate_offline(tmp_path, monkeypatch):
    """wandb's log_images (a list of images per key, each a wandb.Image) and log_table (a
    wandb.Table from columns + data) give the same history rows and the same files, by content
    hash, as accelerate's."""
    pytest.importorskip("wandb")
    from test_tracking import _wait_for_wandb_exit, _wandb_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):  # not shared with another worker
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    images = [(np.arange(8 * 8 * 3).reshape(8, 8, 3) * k % 255).astype(np.uint8) for k in (1, 3)]
    runs = {}
    for who in MAKERS:
        (tmp_path / who).mkdir()
        acc = MAKERS[who](cpu=True, log_with="wandb", project_dir=str(tmp_path / who))
        acc.init_trackers("run", init_kwargs={"wandb": {"dir": str(tmp_path / who)}})
        tracker = acc.get_tracker("wandb")
        tracker.log_images({"samples": images}, step=1)
        tracker.log_table("predictions", columns=["text", "label"], data=[["a b", 1], ["c", 0]], step=2)
        acc.end_training()
        _wait_for_wandb_exit(tmp_path / who)
        history, _ = _wandb_run(tmp_path / who)
        for row in history.values():  # a table's artifact address is a random id per run
            for key in [k for k in row if k.endswith("artifact_path")]:
                row.pop(key)
        files = sorted(os.path.relpath(p, tmp_path / who).split("files/", 1)[1] for p in
                       glob.glob(str(tmp_path / who / "wandb" / "offline-run-*" / "files" / "media" / "**" / "*.*"),
                                 recursive=True))
        runs[who] = (history, files)
    assert runs["ours"] == runs["theirs"]
    history, files = runs["ours"]
    assert sorted(history) == [1, 2]
    assert history[1]["samples/_type"] == "images/separated" and history[1]["samples/count"] == 2
    assert history[2]["predictions/_type"] == "table-file" and history[2]["predictions/nrows"] == 2
    assert len([f for f in files if f.endswith(".png")]) == 2 and any(f.endswith(".table.json") for f in files)


def test_every_tracker_has_accelerates_methods_with_its_parameters():
    """Each of accelerate's trackers (its LOGGER_TYPE_TO_CLASS) has a tracker of the same name
    here with every public method accelerate's has (log_images, log_table, log_figure, ...), each
    taking the same parameters in the same order, so code written against accelerate's tracker
    objects (get_tracker(name).log_table(...)) runs on ours."""
    import inspect

    import accelerate.tracking as acc_tracking

    from accelerate_c.tracking import LOGGER_TYPE_TO_CLASS

    checked = 0
    for name, theirs in acc_tracking.LOGGER_TYPE_TO_CLASS.items():
        ours = LOGGER_TYPE_TO_CLASS[name]
        for attr in [a for a in dir(theirs) if not a.startswith("_") or a == "__init__"]:
            member = getattr(theirs, attr)
            if not inspect.isfunction(member):
                continue
            assert inspect.isfunction(getattr(ours, attr, None)), f"{ours.__name__} lacks {attr}"
            want = list(inspect.signature(member).parameters)
            assert list(inspect.signature(getattr(ours, attr)).parameters) == want, (name, attr)
            checked += 1
    assert checked >= 9 * 6  # every tracker's __init__, start, store_init_configuration, log, finish, ...

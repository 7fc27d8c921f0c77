"""Trackers over other packages' experiment-tracking APIs: wandb, comet_ml, aim, mlflow,
clearml, dvclive, swanlab, trackio. Each is the same thin layer accelerate 1.15 puts over the
package (the same calls, constructor arguments and names), so a run logged through
accelerate_c looks the same in the package's own UI as one logged through accelerate. A
package is imported only when its tracker starts; `filter_trackers` refuses a tracker whose
package is missing, by name, before that.

Values a package cannot take as a metric are skipped with a warning naming the key (as
accelerate's mlflow, clearml and dvclive trackers do).
"""
from __future__ import annotations

import json
import os
import warnings

from .tracker_base import GeneralTracker, on_main_process, plain_value, require_package


def _skipped(tracker: str, key, value, why: str):
    warnings.warn(f"{tracker}.log: {key!r} ({type(value).__name__}) not logged: {why}", stacklevel=3)


def _flag(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "y", "on")


class WandBTracker(GeneralTracker):
    """A wandb run: `wandb.init(project=run_name, **init_kwargs)`. wandb's own settings
    (WANDB_MODE=offline, WANDB_DIR, ...) apply as usual."""

    name = "wandb"
    requires_logging_directory = False
    main_process_only = False  # as accelerate: Accelerator.init_trackers already runs on the main process only

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run = None

    @property
    def tracker(self):
        return self.run

    @on_main_process
    def start(self):
        require_package("wandb")
        import wandb

        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.run.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs):
        import wandb

        for key, images in values.items():
            self.log({key: [wandb.Image(image) for image in images]}, step=step, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns=None, data=None, dataframe=None, step: int | None = None, **kwargs):
        import wandb

        self.log({table_name: wandb.Table(columns=columns, data=data, dataframe=dataframe)}, step=step, **kwargs)

    @on_main_process
    def finish(self):
        if self.run is not None:
            self.run.finish()


class CometMLTracker(GeneralTracker):
    """A Comet experiment: `comet_ml.start(project_name=run_name, **init_kwargs)` (comet_ml >=
    3.41; `comet_ml.Experiment` before). Offline mode and keys come from Comet's own config."""

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.writer = None

    @property
    def tracker(self):
        return self.writer

    @on_main_process
    def start(self):
        require_package("comet_ml")
        import comet_ml
        from packaging import version

        if version.parse(comet_ml.__version__) >= version.parse("3.41.0"):
            self.writer = comet_ml.start(project_name=self.run_name, **self.init_kwargs)
        else:
            self.writer = comet_ml.Experiment(project_name=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.writer.log_parameters(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        if step is not None:
            self.writer.set_step(step)
        for key, value in values.items():
            value = plain_value(value)
            if isinstance(value, (int, float)):
                self.writer.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, step=step, **kwargs)
            else:
                _skipped("CometMLTracker", key, value, "not a number, string or dict")

    @on_main_process
    def finish(self):
        if self.writer is not None:
            self.writer.end()


class AimTracker(GeneralTracker):
    """An Aim run in the repository at the logging directory, named run_name."""

    name = "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir=".", **kwargs):
        super().__init__()
        self.run_name = run_name
        self.aim_repo_path = logging_dir
        self.init_kwargs = kwargs
        self.writer = None

    @property
    def tracker(self):
        return self.writer

    @on_main_process
    def start(self):
        require_package("aim")
        from aim import Run

        self.writer = Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.writer["hparams"] = values

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        for key, value in values.items():
            self.writer.track(plain_value(value), name=key, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, kwargs: dict | None = None):
        import aim

        image_kw = (kwargs or {}).get("aim_image", {})
        track_kw = (kwargs or {}).get("track", {})
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            self.writer.track(aim.Image(image, caption=caption, **image_kw), name=key, step=step, **track_kw)

    @on_main_process
    def finish(self):
        if self.writer is not None:
            self.writer.close()


class MLflowTracker(GeneralTracker):
    """An MLflow run in the experiment named by project_name (MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_ID,
    MLFLOW_TAGS, MLFLOW_NESTED_RUN take priority, as in accelerate); `logging_dir` is the new
    experiment's artifact location. Only numbers are metrics."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str | None = None, logging_dir=None, run_id: str | None = None,
                 tags=None, nested_run: bool = False, run_name: str | None = None, description: str | None = None):
        super().__init__()
        tags = os.environ.get("MLFLOW_TAGS", tags)
        if isinstance(tags, str):
            try:
                tags = json.loads(tags)
            except ValueError:
                raise ValueError(f"MLflowTracker: tags (or MLFLOW_TAGS) {tags!r} is not a JSON object") from None
        nested_run = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = logging_dir
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = tags
        self.nested_run = _flag(nested_run) if isinstance(nested_run, str) else bool(nested_run)
        self.run_name = run_name
        self.description = description
        self.active_run = None

    @property
    def tracker(self):
        return self.active_run

    @on_main_process
    def start(self):
        require_package("mlflow")
        import mlflow

        found = mlflow.search_experiments(filter_string=f"name = '{self.experiment_name}'")
        if found:
            experiment_id = found[0].experiment_id
        else:
            experiment_id = mlflow.create_experiment(name=self.experiment_name, artifact_location=self.logging_dir,
                                                     tags=self.tags)
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment_id, run_name=self.run_name,
                                           nested=self.nested_run, tags=self.tags, description=self.description)

    @on_main_process
    def store_init_configuration(self, values: dict):
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        kept = []
        for key, value in values.items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:
                warnings.warn(f"MLflowTracker: parameter {key!r} is longer than MLflow's {MAX_PARAM_VAL_LENGTH} "
                              "characters; not logged", stacklevel=2)
            else:
                kept.append((key, value))
        for start in range(0, len(kept), MAX_PARAMS_TAGS_PER_BATCH):  # MLflow's batch limit
            mlflow.log_params(dict(kept[start:start + MAX_PARAMS_TAGS_PER_BATCH]))

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        import mlflow

        metrics = {}
        for key, value in values.items():
            value = plain_value(value)
            if isinstance(value, (int, float)):
                metrics[key] = value
            else:
                _skipped("MLflowTracker", key, value, "MLflow metrics are numbers")
        mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure, artifact_file: str, **save_kwargs):
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None):
        import mlflow

        mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None):
        import mlflow

        mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self):
        import mlflow

        mlflow.end_run()


class ClearMLTracker(GeneralTracker):
    """A ClearML task (the current one when the script made it; else `Task.init` with project
    and task names from CLEARML_PROJECT / CLEARML_TASK, else run_name). A key starting with
    eval_/test_/train_ is reported under that series, its prefix removed; others under train."""

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs):
        super().__init__()
        self.user_provided_run_name = run_name
        self.init_kwargs = kwargs
        self.task = None
        self._made_elsewhere = False

    @property
    def tracker(self):
        return self.task

    @on_main_process
    def start(self):
        require_package("clearml")
        from clearml import Task

        current = Task.current_task()
        if current:
            self.task, self._made_elsewhere = current, True
            return
        args = dict(self.init_kwargs)
        args.setdefault("project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name))
        args.setdefault("task_name", os.environ.get("CLEARML_TASK", self.user_provided_run_name))
        self.task = Task.init(**args)

    @on_main_process
    def store_init_configuration(self, values: dict):
        return self.task.connect_configuration(values)

    @staticmethod
    def title_series(name: str):
        for prefix in ("eval", "test", "train"):
            if name.startswith(prefix + "_"):
                return name[len(prefix) + 1:], prefix
        return name, "train"

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        report = self.task.get_logger()
        for key, value in values.items():
            value = plain_value(value)
            if not isinstance(value, (int, float)):
                _skipped("ClearMLTracker", key, value, "ClearML scalars are numbers")
            elif step is None:
                report.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = self.title_series(key)
                report.report_scalar(title=title, series=series, value=value, iteration=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs):
        report = self.task.get_logger()
        for key, image in values.items():
            title, series = self.title_series(key)
            report.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns=None, data=None, dataframe=None, step: int | None = None, **kwargs):
        table = dataframe
        if table is None:
            if data is None:
                raise ValueError("ClearMLTracker.log_table: give data (rows) or a dataframe")
            table = [columns] + data if columns else data
        title, series = self.title_series(table_name)
        self.task.get_logger().report_table(title=title, series=series, table_plot=table, iteration=step, **kwargs)

    @on_main_process
    def finish(self):
        if self.task is not None and not self._made_elsewhere:
            self.task.close()


class DVCLiveTracker(GeneralTracker):
    """A `dvclive.Live(**init_kwargs)` (or the `live` given); run_name is not used, as in
    accelerate. Every log call is one dvclive step."""

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live=None, **kwargs):
        super().__init__()
        self.live = live
        self.init_kwargs = kwargs

    @property
    def tracker(self):
        return self.live

    @on_main_process
    def start(self):
        require_package("dvclive")
        from dvclive import Live

        if self.live is None:
            self.live = Live(**self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.live.log_params(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for key, value in values.items():
            value = plain_value(value)
            if Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                _skipped("DVCLiveTracker", key, value, "dvclive metrics are numbers")
        self.live.next_step()

    @on_main_process
    def finish(self):
        if self.live is not None:
            self.live.end()


class SwanLabTracker(GeneralTracker):
    """A SwanLab run: `swanlab.init(project=run_name, **init_kwargs)`."""

    name = "swanlab"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run = None

    @property
    def tracker(self):
        return self.run

    @on_main_process
    def start(self):
        require_package("swanlab")
        import swanlab

        self.run = swanlab.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict):
        import swanlab

        swanlab.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs):
        import swanlab

        for key, images in values.items():
            self.log({key: [swanlab.Image(image) for image in images]}, step=step, **kwargs)

    @on_main_process
    def finish(self):
        if self.run is not None:
            self.run.finish()


class TrackioTracker(GeneralTracker):
    """A trackio run: `trackio.init(project=run_name, **init_kwargs)`."""

    name = "trackio"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run = None

    @property
    def tracker(self):
        return self.run

    @on_main_process
    def start(self):
        require_package("trackio")
        import trackio

        self.run = trackio.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict):
        import trackio

        trackio.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self):
        if self.run is not None:
            self.run.finish()


ADAPTERS = {cls.name: cls for cls in (WandBTracker, CometMLTracker, AimTracker, MLflowTracker, ClearMLTracker,
                                      DVCLiveTracker, SwanLabTracker, TrackioTracker)}

"""The Trainer's evaluation side: `prediction_step`, `evaluate`, `predict` and the metric
reports (`log_metrics`, `save_metrics`, `save_state`), as transformers' Trainer has them. A mixin
of trainer.Trainer: it uses the Trainer's accelerator, model, args, state, callbacks and its
public `compute_loss`, `get_eval_dataloader`, `log`."""
from __future__ import annotations

import datetime
import json
import os
import time
from collections import namedtuple

import torch

from .training_args import EvalPrediction
from .trainer_utils import TRAINER_STATE_NAME, batch_size_of, concat_nested, detach_cpu, pad_tokens, to_numpy

PredictionOutput = namedtuple("PredictionOutput", ["predictions", "label_ids", "metrics"])


def default_ignore_keys(model) -> list:
    """The output keys left out of the predictions when the caller names none: a transformers
    model's `config.keys_to_ignore_at_inference` (a causal LM's cache, `past_key_values`, is not a
    prediction and cannot be gathered), else none; as transformers decides."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    return list(getattr(config, "keys_to_ignore_at_inference", ["past_key_values"]))


def _format_metric(key, value):
    """A metric as log_metrics prints it (transformers' formats: sizes in MB, runtimes as
    h:mm:ss.ff, flos in GF, floats to 4 decimals)."""
    if "_mem_" in key:
        return f"{value >> 20}MB"
    if "_runtime" in key:
        return f"{datetime.timedelta(seconds=int(value))}.{int(abs(value - int(value)) * 100):02d}"
    if key == "total_flos":
        return f"{int(value) >> 30}GF"
    if isinstance(value, float):
        return round(value, 4)
    return value


class EvaluationLoop:
    """evaluate / predict / metric reports, mixed into the Trainer."""

    def prediction_step(self, model, inputs, prediction_loss_only=False, ignore_keys=None):
        """(loss, logits, labels) for one batch, without gradients. The outputs named in
        `ignore_keys` (default: default_ignore_keys(model)) and the loss are not predictions."""
        labels = self._labels_of(inputs)
        has_labels = labels is not None
        if ignore_keys is None:
            ignore_keys = default_ignore_keys(self.accelerator.unwrap_model(model, keep_torch_compile=False))
        with torch.no_grad():
            if has_labels:
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                loss = loss.detach()
            else:
                loss = None
                outputs = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        if prediction_loss_only:
            return loss, None, None
        ignore = set(ignore_keys) | {"loss"}
        if isinstance(outputs, dict) or hasattr(outputs, "keys"):
            logits = tuple(v for k, v in outputs.items() if k not in ignore)
            logits = logits[0] if len(logits) == 1 else logits
        elif isinstance(outputs, (tuple, list)):
            logits = tuple(outputs[1:]) if (has_labels and self.compute_loss_func is None) else tuple(outputs)
            logits = logits[0] if len(logits) == 1 else logits
        else:
            logits = outputs
        return loss, logits, labels

    def _evaluation_loop(self, dataset, ignore_keys, prefix: str, prediction_loss_only: bool):
        """Runs the model over `dataset`: (predictions, label_ids, metrics), the arrays gathered
        over every process (each sample once: gather_for_metrics drops the duplicates that
        filled the last batch; token outputs padded across processes with -100)."""
        acc = self.accelerator
        dl = self.get_eval_dataloader(dataset)
        model = self._prepare_model()
        was_training = model.training
        model.eval()
        start = time.time()
        losses, preds, labels = [], [], []
        n = 0
        for inputs in dl:
            loss, logits, lab = self.prediction_step(model, inputs, prediction_loss_only=prediction_loss_only,
                                                     ignore_keys=ignore_keys)
            bs = batch_size_of(inputs)
            if loss is not None:
                losses.append(acc.gather_for_metrics(loss.reshape(1).repeat(bs)).float().cpu())
            if not prediction_loss_only:
                # transformers' order: padded across processes first (-100), then preprocessed,
                # so the hook sees the padded positions as transformers' does
                if acc.num_processes > 1:
                    logits = pad_tokens(acc, logits)
                    lab = pad_tokens(acc, lab) if lab is not None else None
                if self.preprocess_logits_for_metrics is not None:
                    logits = self.preprocess_logits_for_metrics(logits, lab)
                preds.append(detach_cpu(acc.gather_for_metrics(logits)))
                if lab is not None:
                    labels.append(detach_cpu(acc.gather_for_metrics(lab)))
            n += bs
        if was_training:
            model.train()
        p = to_numpy(concat_nested(preds)) if preds else None
        l_ = to_numpy(concat_nested(labels)) if labels else None
        metrics = {}
        if self.compute_metrics is not None and p is not None and l_ is not None:
            metrics = dict(self.compute_metrics(EvalPrediction(p, l_)))
        if losses:
            metrics["loss"] = torch.cat(losses).mean().item()
        runtime = time.time() - start
        total = n * acc.num_processes
        metrics.update(runtime=round(runtime, 4),
                       samples_per_second=round(total / runtime, 3) if runtime > 0 else 0.0)
        metrics = {(k if k.startswith(f"{prefix}_") else f"{prefix}_{k}"): v for k, v in metrics.items()}
        return p, l_, metrics

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """{prefix_loss, compute_metrics' results (prefixed), prefix_runtime, ...} over the eval
        set, gathered over all processes. Predictions are collected only when compute_metrics
        is given and args.prediction_loss_only is False (transformers' rule)."""
        loss_only = self.compute_metrics is None or self.args.prediction_loss_only
        _, _, metrics = self._evaluation_loop(eval_dataset, ignore_keys, metric_key_prefix, loss_only)
        self.log(metrics)
        self.control = self._call("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        """PredictionOutput(predictions, label_ids, metrics) over `test_dataset` (numpy arrays;
        label_ids None without labels; predictions None under args.prediction_loss_only)."""
        if test_dataset is None:
            raise ValueError("Trainer.predict: test_dataset is required")
        p, l_, metrics = self._evaluation_loop(test_dataset, ignore_keys, metric_key_prefix,
                                               self.args.prediction_loss_only)
        self.control = self._call("on_predict", metrics=metrics)
        return PredictionOutput(p, l_, metrics)

    # ------------------------------------------------------------------ metric reports
    def log_metrics(self, split: str, metrics: dict):
        """Prints `metrics` as a `***** split metrics *****` block (main process only)."""
        if not self.is_world_process_zero():
            return
        shown = {k: _format_metric(k, v) for k, v in metrics.items()}
        key_w = max((len(str(k)) for k in shown), default=0)
        value_w = max((len(str(v)) for v in shown.values()), default=0)
        print(f"***** {split} metrics *****")
        for key in sorted(shown):
            print(f"  {key: <{key_w}} = {shown[key]:>{value_w}}")

    def save_metrics(self, split: str, metrics: dict, combined: bool = True):
        """output_dir/{split}_results.json, and all_results.json updated with them when combined
        (main process only)."""
        if not self.is_world_process_zero():
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, f"{split}_results.json"), "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=4, sort_keys=True)
        if combined:
            path = os.path.join(self.args.output_dir, "all_results.json")
            merged = {}
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    merged = json.load(f)
            merged.update(metrics)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(merged, f, indent=4, sort_keys=True)

    def save_state(self):
        """output_dir/trainer_state.json (main process only)."""
        if not self.is_world_process_zero():
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        self.state.save_to_json(os.path.join(self.args.output_dir, TRAINER_STATE_NAME))

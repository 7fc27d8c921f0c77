"""Trainer: transformers' Trainer loop (train / evaluate / checkpoints / resume) on the public
Accelerator API. Parameter names and order are transformers' for what it supports; see
docs/trainer.md for the differences."""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import shutil
import sys
import time
import warnings
from collections import namedtuple

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from .accelerator import Accelerator
from .checkpointing import torch_save_durable
from .compilation import plain_keys
from .length_grouped import LengthGroupedSampler, lengths_of
from .metric_schedules import is_metric_driven
from .trainer_eval import EvaluationLoop, PredictionOutput  # noqa: F401  (PredictionOutput: transformers' name)
from .training_args import (  # noqa: F401  (re-exported: transformers has them in its trainer modules)
    EvalPrediction,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    get_decay_parameter_names,
    get_scheduler,
    load_training_args,
)
from .trainer_utils import (  # noqa: F401  (get_last_checkpoint, default_data_collator: transformers' names)
    PREFIX_CHECKPOINT_DIR,
    TRAINER_STATE_NAME,
    RemoveColumnsCollator,
    default_data_collator,
    get_last_checkpoint,
    is_causal_lm,
    label_smoothed_loss,
    output_field,
    sorted_checkpoints,
    tracker_config,
)
from .utils.operations import fp32_loss_only
from .utils.random import set_seed

SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"

TrainOutput = namedtuple("TrainOutput", ["global_step", "training_loss", "metrics"])


class Trainer(EvaluationLoop):
    """transformers' Trainer loop on accelerate_c's Accelerator.

    The batch goes to the model as transformers sends it: a dict batch as `model(**batch)` (so
    a model taking `labels` computes its own loss), otherwise (a tuple/list such as a
    TensorDataset's) as `model(*batch[:-1])` with `batch[-1]` as the labels. The loss is the
    model output's "loss" (a dict key or attribute) unless `compute_loss_func` is given, in
    which case labels are taken out of the batch and the loss is
    `compute_loss_func(outputs, labels[, num_items_in_batch=None])`."""

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, model_init=None, compute_loss_func=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, **kwargs):
        if "tokenizer" in kwargs:  # transformers' older name for processing_class
            if processing_class is not None:
                raise ValueError("Trainer: pass processing_class or tokenizer, not both")
            processing_class = kwargs.pop("tokenizer")
        for name, value in kwargs.items():
            if value is not None:
                raise TypeError(f"Trainer({name}=...): not supported by accelerate_c's Trainer")
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        self.args = load_training_args(args)
        if self.args.full_determinism:
            set_seed(self.args.seed, deterministic=True)
        else:
            set_seed(self.args.seed)
        self.model_init = model_init
        if model is None:
            if model_init is None:
                raise RuntimeError("Trainer requires either a model or a model_init function")
            model = self._call_model_init()
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer(model=...): expected a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizers, (tuple, list)) or len(optimizers) != 2:
            raise ValueError("Trainer(optimizers=...): expected a tuple (optimizer, lr_scheduler)")
        if optimizer_cls_and_kwargs is not None and optimizers[0] is not None:
            raise RuntimeError("Trainer: pass either optimizers or optimizer_cls_and_kwargs, not both")
        self.model = model
        self.accelerator = Accelerator.from_training_args(self.args)
        self.data_collator = data_collator if data_collator is not None else default_data_collator
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self._own_optimizer = self.optimizer is None
        self._own_scheduler = self.lr_scheduler is None
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.callbacks = []
        for cb in callbacks or []:
            self.add_callback(cb)
        self.state = TrainerState(is_local_process_zero=self.accelerator.is_local_main_process,
                                  is_world_process_zero=self.accelerator.is_main_process)
        self.control = TrainerControl()
        self._train_dl = None
        self._eval_dls = {}
        self._prepared_model = False
        self._call("on_init_end")

    # ------------------------------------------------------------------ small API
    def add_callback(self, callback):
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def remove_callback(self, callback):
        for cb in list(self.callbacks):
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return

    def pop_callback(self, callback):
        for cb in list(self.callbacks):
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def _call(self, event, **kwargs):
        for cb in self.callbacks:
            fn = getattr(cb, event, None)
            if fn is None:
                continue
            result = fn(self.args, self.state, self.control, model=self.model, optimizer=self.optimizer,
                        lr_scheduler=self.lr_scheduler, train_dataloader=self._train_dl,
                        processing_class=self.processing_class, **kwargs)
            if result is not None:
                self.control = result
        return self.control

    def _call_model_init(self):
        params = inspect.signature(self.model_init).parameters
        model = self.model_init(None) if len(params) == 1 else self.model_init()
        if model is None:
            raise RuntimeError("model_init should not return None")
        return model

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    def _print(self, text):
        if self.accelerator.is_main_process:
            bar = getattr(self, "_bar", None)
            if bar is not None:
                bar.write(text)
            else:
                print(text, flush=True)

    # ------------------------------------------------------------------ data
    def _collator_for(self, dataset):
        collator = self.data_collator
        if self.args.remove_unused_columns:
            try:
                sample = dataset[0] if not isinstance(dataset, IterableDataset) else None
            except Exception:  # noqa: BLE001 - datasets without indexing: nothing to remove
                sample = None
            if isinstance(sample, dict):
                # (the model's own forward: a compiled wrapper's is (*args, **kwargs))
                params = inspect.signature(self._inner_model().forward).parameters
                if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                    keep = set(params) | {"label", "label_ids", "labels"} | set(self.args.label_names or [])
                    collator = RemoveColumnsCollator(collator, keep)
        return collator

    def _loader(self, dataset, batch_size, sampler, drop_last):
        a = self.args
        kw = dict(batch_size=batch_size, collate_fn=self._collator_for(dataset), drop_last=drop_last,
                  num_workers=a.dataloader_num_workers,
                  # pinned memory only helps copies to an accelerator (torch warns on a CPU-only run)
                  pin_memory=a.dataloader_pin_memory and self.accelerator.device.type != "cpu",
                  persistent_workers=a.dataloader_persistent_workers)
        if a.dataloader_prefetch_factor is not None:
            kw["prefetch_factor"] = a.dataloader_prefetch_factor
        if sampler is not None:
            kw["sampler"] = sampler
        return DataLoader(dataset, **kw)

    def _inner_model(self):
        """The user's model, inside the compiled wrapper prepare() may have made."""
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    def _lengths(self, dataset, what):
        """The sample lengths for group_by_length, found as transformers' Trainer finds them. Its
        datasets.Dataset loses the columns the model's forward does not name (remove_unused_columns)
        before the lengths are read, so the length column counts only when it survives that."""
        a = self.args
        column = a.length_column_name
        if a.remove_unused_columns:
            forward = self._inner_model().forward
            kept = set(inspect.signature(forward).parameters) | {"label", "label_ids"} | set(a.label_names or [])
            column = column if column in kept else None
        names = getattr(self.processing_class, "model_input_names", None) if self.processing_class is not None \
            else None
        return lengths_of(dataset, names[0] if names else None, column, what)

    def _train_sampler(self, ds):
        """transformers' train_sampling_strategy: RandomSampler, SequentialSampler, or the
        length-grouped order over batches of per_device_train_batch_size x accumulation (its
        permutation from the global RNG, as transformers')."""
        a = self.args
        if isinstance(ds, IterableDataset):
            if a.train_sampling_strategy == "group_by_length":
                warnings.warn("train_sampling_strategy='group_by_length' is ignored: the training dataset is an "
                              "IterableDataset, whose samples come in its own order", stacklevel=3)
            return None
        if a.train_sampling_strategy == "group_by_length":
            return LengthGroupedSampler(a.per_device_train_batch_size * a.gradient_accumulation_steps,
                                        lengths=self._lengths(ds, "training dataset"))
        return SequentialSampler(ds) if a.train_sampling_strategy == "sequential" else RandomSampler(ds)

    def get_train_dataloader(self):
        """The training DataLoader (one per Trainer; its order per train_sampling_strategy),
        prepared by the Accelerator."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset")
        if self._train_dl is None:
            ds = self.train_dataset
            dl = self._loader(ds, self.args.per_device_train_batch_size, self._train_sampler(ds),
                              self.args.dataloader_drop_last)
            self._train_dl = self.accelerator.prepare(dl)
        return self._train_dl

    def get_eval_dataloader(self, eval_dataset=None):
        """The evaluation DataLoader, prepared by the Accelerator; one per dataset. In order,
        except under train_sampling_strategy="group_by_length", where transformers' Trainer
        evaluates in length-grouped order too, drawn from a generator seeded with data_seed (else
        seed) each time it builds the loader: the same order at every evaluation."""
        ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        if ds is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset")
        key = id(ds)
        a = self.args
        if key not in self._eval_dls:
            sampler = None if isinstance(ds, IterableDataset) else SequentialSampler(ds)
            if sampler is not None and a.train_sampling_strategy == "group_by_length":
                sampler = LengthGroupedSampler(a.per_device_eval_batch_size, lengths=self._lengths(ds, "eval dataset"),
                                               generator=torch.Generator())
            dl = self._loader(ds, a.per_device_eval_batch_size, sampler, a.dataloader_drop_last)
            self._eval_dls[key] = (ds, self.accelerator.prepare(dl), sampler)
        sampler = self._eval_dls[key][2]
        if isinstance(sampler, LengthGroupedSampler):  # the loader is kept: its order starts over instead
            sampler.generator.manual_seed(a.data_seed if a.data_seed is not None else a.seed)
        return self._eval_dls[key][1]

    # ------------------------------------------------------------------ optimizer and schedule
    def create_optimizer(self):
        if self.optimizer is not None:
            return self.optimizer
        a = self.args
        decay = set(get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": a.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
            self.optimizer = cls(groups, **kwargs)
        elif a.optim in ("adamw_torch", "adamw_torch_fused"):
            kw = {"fused": True} if a.optim == "adamw_torch_fused" else {}
            self.optimizer = torch.optim.AdamW(groups, lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2),
                                               eps=a.adam_epsilon, **kw)
        elif a.optim == "sgd":
            self.optimizer = torch.optim.SGD(groups, lr=a.learning_rate)
        else:
            self.optimizer = torch.optim.Adagrad(groups, lr=a.learning_rate)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            optimizer = optimizer if optimizer is not None else self.optimizer
            optimizer = getattr(optimizer, "optimizer", optimizer)  # the unwrapped one
            self.lr_scheduler = get_scheduler(self.args.lr_scheduler_type, optimizer,
                                              num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
                                              num_training_steps=num_training_steps,
                                              **self.args.lr_scheduler_kwargs)
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int):
        self.create_optimizer()
        self.create_scheduler(num_training_steps)

    def _prepare_model(self):
        if not self._prepared_model:
            self.model = self.accelerator.prepare(self.model)
            self._prepared_model = True
        return self.model

    # ------------------------------------------------------------------ loss
    def _labels_of(self, inputs):
        if isinstance(inputs, dict):
            names = self.args.label_names or ["labels"]
            return inputs.get(names[0]) if len(names) == 1 else tuple(inputs.get(n) for n in names)
        return inputs[-1]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's own "loss" output, or compute_loss_func(outputs, labels)."""
        labels = None
        smoothing = self.args.label_smoothing_factor
        if isinstance(inputs, dict):
            if smoothing and self.compute_loss_func is None and inputs.get("labels") is not None:
                # transformers' label smoothing: the model runs without labels, the loss is ours
                inputs = dict(inputs)
                labels = inputs.pop("labels")
                outputs = model(**inputs)
                shift = is_causal_lm(self.accelerator.unwrap_model(model))
                loss = label_smoothed_loss(outputs, labels, smoothing, shift=shift)
                return (loss, outputs) if return_outputs else loss
            if self.compute_loss_func is not None:
                inputs = dict(inputs)
                labels = tuple(inputs.pop(n) for n in (self.args.label_names or ["labels"]) if n in inputs)
                labels = labels[0] if len(labels) == 1 else (labels or None)
            # only the loss is read: the forward converts nothing else to fp32 (fp32_loss_only)
            loss_only = not return_outputs and self.compute_loss_func is None
            with fp32_loss_only() if loss_only else contextlib.nullcontext():
                outputs = model(**inputs)
        elif isinstance(inputs, (list, tuple)):
            if len(inputs) < 2:
                raise ValueError("Trainer: a tuple batch must be (inputs..., labels)")
            labels = inputs[-1]
            outputs = model(*inputs[:-1])
        else:
            raise TypeError(f"Trainer: batches must be dicts or tuples/lists, got {type(inputs).__name__}")
        if self.compute_loss_func is not None:
            fn = self.compute_loss_func
            try:
                params = inspect.signature(fn).parameters
                takes_n = "num_items_in_batch" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
            except (TypeError, ValueError):
                takes_n = False
            loss = fn(outputs, labels, num_items_in_batch=num_items_in_batch) if takes_n else fn(outputs, labels)
        else:
            loss = output_field(outputs, "loss")
            if loss is None and isinstance(outputs, (tuple, list)) and isinstance(inputs, dict) and \
                    "labels" in inputs:
                loss = outputs[0]
            if loss is None:
                raise ValueError("Trainer: the model did not return a loss (a 'loss' key or attribute). Give it "
                                 "the labels (a dict batch with 'labels') or pass compute_loss_func=f, called as "
                                 "f(outputs, labels)")
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward, loss, accelerator.backward; returns the loss / gradient_accumulation_steps."""
        model.train()
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        self.accelerator.backward(loss)
        return loss.detach() / self.accelerator.gradient_accumulation_steps

    # ------------------------------------------------------------------ training
    def _steps_value(self, value, max_steps):
        return None if value is None else (math.ceil(max_steps * value) if value < 1 else int(value))

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Trains; `resume_from_checkpoint` a checkpoint folder, or True for the latest complete
        `checkpoint-N` in output_dir. Returns TrainOutput(global_step, training_loss, metrics)."""
        if trial is not None:
            raise NotImplementedError("Trainer.train(trial=...): hyperparameter search is not supported yet")
        if kwargs:
            raise TypeError(f"Trainer.train() got unexpected arguments {sorted(kwargs)}")
        args = self.args
        if resume_from_checkpoint is False:
            resume_from_checkpoint = None
        if self._own_scheduler:
            self.lr_scheduler = None  # rebuilt for this call's number of steps, as transformers does
        if self.model_init is not None:
            if self._prepared_model:  # a fresh model: drop everything prepared for the old one
                self.accelerator.free_memory()
                self._train_dl, self._eval_dls, self._prepared_model = None, {}, False
                self.optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
            set_seed(args.seed, deterministic=args.full_determinism)
            self.model = self._call_model_init()
            if self._own_optimizer:
                self.optimizer = None
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({args.output_dir})")
        if resume_from_checkpoint is not None:
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
            if not os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)):
                raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint} (no "
                                 f"{TRAINER_STATE_NAME}: not a checkpoint, or an incomplete one)")
        acc = self.accelerator
        train_dl = self.get_train_dataloader()
        if args.eval_strategy != "no" or args.eval_on_start:
            if self.eval_dataset is None:
                raise ValueError(f"Trainer: eval_strategy={args.eval_strategy!r} needs an eval_dataset")
            self.get_eval_dataloader()  # prepared before any checkpoint is loaded: the same order every run
        ga = acc.gradient_accumulation_steps
        try:
            len_dl = len(train_dl)
        except TypeError:
            len_dl = None
        if len_dl is not None:
            per_epoch = max(len_dl // ga + int(len_dl % ga > 0), 1)
            if args.max_steps > 0:
                max_steps = args.max_steps
                num_epochs = max_steps // per_epoch + int(max_steps % per_epoch > 0)
            else:
                max_steps = math.ceil(args.num_train_epochs * per_epoch)
                num_epochs = math.ceil(args.num_train_epochs)
        elif args.max_steps > 0:
            max_steps, num_epochs, per_epoch = args.max_steps, sys.maxsize, args.max_steps
        else:
            raise ValueError("TrainingArguments.max_steps must be set to a positive value when the train dataset "
                             "has no length")
        if args.gradient_checkpointing:
            enable = getattr(self.model, "gradient_checkpointing_enable", None)
            if enable is None:
                raise ValueError("TrainingArguments.gradient_checkpointing=True: the model has no "
                                 "gradient_checkpointing_enable()")
            enable()
        model = self._prepare_model()
        self.create_optimizer()
        self.create_scheduler(max_steps)
        if is_metric_driven(self.lr_scheduler) and args.metric_for_best_model is None:
            raise ValueError(f"Trainer: the learning-rate schedule ({type(self.lr_scheduler).__name__}) is stepped with "
                             "an evaluation metric: set TrainingArguments.metric_for_best_model (and an eval_strategy)")
        self.optimizer = acc.prepare(self.optimizer)

        self.state = TrainerState(max_steps=max_steps, num_train_epochs=num_epochs,
                                  train_batch_size=args.per_device_train_batch_size,
                                  logging_steps=self._steps_value(args.logging_steps, max_steps),
                                  eval_steps=self._steps_value(args.eval_steps, max_steps),
                                  save_steps=self._steps_value(args.save_steps, max_steps),
                                  is_local_process_zero=acc.is_local_main_process,
                                  is_world_process_zero=acc.is_main_process)
        epochs_trained, batches_to_skip = 0, 0
        if resume_from_checkpoint is not None:
            self._load_checkpoint(resume_from_checkpoint)
            epochs_trained = self.state.global_step // per_epoch
            batches_to_skip = (self.state.global_step % per_epoch) * ga
            self._print(f"Resuming from {resume_from_checkpoint}: global step {self.state.global_step}, "
                        f"epoch {epochs_trained}, skipping {batches_to_skip} batches")
        self.control = TrainerControl()
        self._tr_loss = torch.zeros((), device=acc.device)
        self._logged_loss_sum = 0.0
        self._last_logged_step = self.state.global_step
        self._grad_norm = None
        self._learning_rate = None
        start = time.time()
        start_step = self.state.global_step
        self._bar = None
        if not args.disable_tqdm and acc.is_local_main_process:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=max_steps, initial=self.state.global_step, dynamic_ncols=True)
        if acc.log_with and not acc.trackers:  # report_to: the Accelerator's trackers (training_args.py)
            acc.init_trackers(args.run_name or os.path.basename(os.path.normpath(args.output_dir)) or "trainer",
                              config=tracker_config(args))
        self._call("on_train_begin")
        if args.eval_on_start:
            self._evaluate(ignore_keys_for_eval, skip_scheduler=True)
        try:
            self._loop(model, train_dl, epochs_trained, num_epochs, batches_to_skip, ignore_keys_for_eval)
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        self._logged_loss_sum += self.accelerator.reduce(self._tr_loss.detach().clone(), "mean").item()
        if args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._print(f"Loading best model from {self.state.best_model_checkpoint} (score: "
                        f"{self.state.best_metric})")
            acc.load_state(self.state.best_model_checkpoint)
        runtime = time.time() - start
        steps_done = self.state.global_step - start_step
        n_samples = steps_done * args.per_device_train_batch_size * ga * acc.num_processes
        train_loss = self._logged_loss_sum / max(1, self.state.global_step - start_step) if steps_done else 0.0
        metrics = {"train_runtime": round(runtime, 4),
                   "train_samples_per_second": round(n_samples / runtime, 3) if runtime > 0 else 0.0,
                   "train_steps_per_second": round(steps_done / runtime, 3) if runtime > 0 else 0.0,
                   "total_flos": self.state.total_flos, "train_loss": train_loss}
        self.log(metrics)
        self._call("on_train_end")
        acc.finish_trackers()
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _loop(self, model, train_dl, epochs_trained, num_epochs, batches_to_skip, ignore_keys):
        acc, args, state = self.accelerator, self.args, self.state
        if state.global_step >= state.max_steps:
            return  # resumed from a checkpoint of a finished run
        for epoch in range(epochs_trained, num_epochs):
            if hasattr(train_dl, "set_epoch"):
                train_dl.set_epoch(epoch)
            epoch_dl, skipped = train_dl, 0
            try:
                steps_in_epoch = len(train_dl)
            except TypeError:
                steps_in_epoch = state.max_steps * acc.gradient_accumulation_steps
            if epoch == epochs_trained and batches_to_skip > 0:
                epoch_dl, skipped = acc.skip_first_batches(train_dl, batches_to_skip), batches_to_skip
                epoch_dl.set_epoch(epoch) if hasattr(epoch_dl, "set_epoch") else None
            self.control.should_epoch_stop = False
            self.control = self._call("on_epoch_begin")
            batches = _rng_neutral_start(iter(epoch_dl)) if skipped else iter(epoch_dl)
            for step, inputs in enumerate(batches):
                if (step + skipped) % acc.gradient_accumulation_steps == 0:  # the count the loop accumulates by
                    self.control = self._call("on_step_begin")
                with acc.accumulate(model):
                    loss = self.training_step(model, inputs)
                if args.logging_nan_inf_filter and not torch.isfinite(loss):
                    # as transformers: a non-finite loss counts as the average so far
                    loss = self._tr_loss / (1 + state.global_step - self._last_logged_step)
                self._tr_loss += loss
                if acc.sync_gradients:
                    if args.max_grad_norm and args.max_grad_norm > 0:
                        self._grad_norm = acc.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    self.optimizer.step()
                    # the rate this step used, logged as transformers logs it (before the schedule moves)
                    self._learning_rate = self._current_learning_rate()
                    # a metric-driven schedule moves after evaluations instead (_evaluate)
                    if not acc.optimizer_step_was_skipped and not is_metric_driven(self.lr_scheduler):
                        self.lr_scheduler.step()
                    self.optimizer.zero_grad()
                    state.global_step += 1
                    state.epoch = epoch + (step + 1 + skipped) / steps_in_epoch
                    if self._bar is not None:
                        self._bar.update(1)
                    self._flow_step_end()
                    self.control = self._call("on_step_end")
                    self._maybe_log_save_evaluate(ignore_keys)
                if self.control.should_epoch_stop or self.control.should_training_stop:
                    break
            else:
                state.epoch = epoch + 1
            self._flow_epoch_end()
            self.control = self._call("on_epoch_end")
            self._maybe_log_save_evaluate(ignore_keys)
            if self.control.should_training_stop:
                break

    def _flow_step_end(self):
        """transformers' DefaultFlowCallback at the end of an optimizer step."""
        a, s, c = self.args, self.state, self.control
        c._new_step()
        if s.global_step == 1 and a.logging_first_step:
            c.should_log = True
        if a.logging_strategy == "steps" and s.global_step % s.logging_steps == 0:
            c.should_log = True
        if a.eval_strategy == "steps" and s.global_step % s.eval_steps == 0:
            c.should_evaluate = True
        if a.save_strategy == "steps" and s.global_step % s.save_steps == 0:
            c.should_save = True
        if s.global_step >= s.max_steps:
            c.should_training_stop = True
            if a.save_strategy == "steps":  # ("epoch" saves at the epoch's end, which follows)
                c.should_save = True

    def _flow_epoch_end(self):
        a, c = self.args, self.control
        c._new_step()
        if a.logging_strategy == "epoch":
            c.should_log = True
        if a.eval_strategy == "epoch":
            c.should_evaluate = True
        if a.save_strategy == "epoch":
            c.should_save = True

    def _maybe_log_save_evaluate(self, ignore_keys):
        c, s = self.control, self.state
        if c.should_log and s.global_step > self._last_logged_step:
            mean = self.accelerator.reduce(self._tr_loss.detach().clone(), "mean").item()
            steps = s.global_step - self._last_logged_step
            self._logged_loss_sum += mean
            logs = {"loss": round(mean / steps, 4)}
            if self._grad_norm is not None:  # read here, not at every step: no device sync per step
                logs["grad_norm"] = float(self._grad_norm)
            logs["learning_rate"] = self._learning_rate if self._learning_rate is not None else \
                self._current_learning_rate()
            self._tr_loss.zero_()
            self._last_logged_step = s.global_step
            self.log(logs)
        metrics = None
        if c.should_evaluate:
            metrics = self._evaluate(ignore_keys)
        if c.should_save or (self.args.save_strategy == "best" and metrics is not None and
                             s.best_global_step == s.global_step):
            self._save_checkpoint(metrics)
            self.control = self._call("on_save")
        c._new_step()

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict):
        """Adds epoch and step, appends to state.log_history and prints on the main process."""
        logs = dict(logs)
        if self.state.epoch is not None:
            logs["epoch"] = round(self.state.epoch, 4)
        self.state.log_history.append({**logs, "step": self.state.global_step})
        if self.accelerator.trackers:
            self.accelerator.log(logs, step=self.state.global_step)
        self._print(str(logs))
        self.control = self._call("on_log", logs=logs)

    def _current_learning_rate(self) -> float:
        """The first group's rate now: the schedule's last rate, or, for a metric-driven schedule
        (which changes the optimizer's rates itself), the optimizer's (transformers' reading)."""
        if is_metric_driven(self.lr_scheduler):
            lr = self.optimizer.param_groups[0]["lr"]
        else:
            lr = self.lr_scheduler.get_last_lr()[0]
        return lr.item() if torch.is_tensor(lr) else lr

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, ignore_keys, skip_scheduler=False):
        """evaluate() during training; then a metric-driven schedule (reduce_lr_on_plateau,
        greedy) steps with metric_for_best_model's value, except for eval_on_start (transformers'
        rule)."""
        metrics = self.evaluate(ignore_keys=ignore_keys)
        name = self.args.metric_for_best_model
        if name is not None:
            key = name if name.startswith("eval_") else f"eval_{name}"
            if key not in metrics:
                raise KeyError(f"metric_for_best_model={name!r}: no {key!r} among the evaluation metrics "
                               f"{sorted(metrics)}")
            if is_metric_driven(self.lr_scheduler) and not skip_scheduler:
                self.lr_scheduler.step(metrics[key])
            value, s = float(metrics[key]), self.state
            better = s.best_metric is None or (value > s.best_metric if self.args.greater_is_better
                                               else value < s.best_metric)
            if better:
                s.best_metric, s.best_global_step = value, s.global_step
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _writes(self) -> bool:
        acc = self.accelerator
        return acc.is_local_main_process if self.args.save_on_each_node else acc.is_main_process

    def _save_checkpoint(self, metrics=None):
        """output_dir/checkpoint-{global_step}: the Accelerator's save_state (model, optimizer,
        scaler, RNG), scheduler.pt, then trainer_state.json, written last: its presence marks
        the checkpoint complete. Older checkpoints beyond save_total_limit are removed after."""
        acc, args, s = self.accelerator, self.args, self.state
        ckpt = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{s.global_step}")
        if self._writes() and os.path.isdir(ckpt):
            shutil.rmtree(ckpt)  # a stale or incomplete one from an earlier run
        acc.wait_for_everyone()
        if args.save_only_model:
            acc.save_model(self.model, ckpt, safe_serialization=args.save_safetensors)
        else:
            acc.save_state(ckpt, safe_serialization=args.save_safetensors)
        if metrics is not None and args.metric_for_best_model is not None and s.best_global_step == s.global_step:
            s.best_model_checkpoint = ckpt
        if self._writes():
            os.makedirs(ckpt, exist_ok=True)
            if not args.save_only_model:
                # durable before trainer_state.json, the marker that says the checkpoint is complete
                torch_save_durable(self.lr_scheduler.state_dict(), os.path.join(ckpt, SCHEDULER_NAME))
            if hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(ckpt)
            s.save_to_json(os.path.join(ckpt, TRAINER_STATE_NAME))
        acc.wait_for_everyone()
        if self._writes() and args.save_total_limit is not None:
            self._rotate_checkpoints(args.save_total_limit)
        acc.wait_for_everyone()

    def _rotate_checkpoints(self, limit: int):
        """Removes the oldest checkpoints (by step) beyond `limit`. The one just written is
        always kept (even when an earlier run left higher-numbered ones), and so is the best
        one under load_best_model_at_end."""
        ckpts = sorted_checkpoints(self.args.output_dir)
        keep = {os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")}
        if self.state.best_model_checkpoint is not None and self.args.load_best_model_at_end:
            keep.add(self.state.best_model_checkpoint)
        kept = [p for p in ckpts if p in keep]
        others = [p for p in ckpts if p not in keep]
        for path in others[: max(0, len(others) - max(0, limit - len(kept)))]:
            shutil.rmtree(path, ignore_errors=True)

    def _load_checkpoint(self, path: str):
        if not os.path.isfile(os.path.join(path, SCHEDULER_NAME)):
            raise ValueError(f"{path} holds no optimizer/scheduler state to resume from (saved with "
                             "save_only_model=True?)")
        self.accelerator.load_state(path)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(path, SCHEDULER_NAME), weights_only=True))
        saved = TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_NAME))
        for name in ("global_step", "epoch", "log_history", "best_metric", "best_global_step",
                     "best_model_checkpoint", "total_flos"):
            setattr(self.state, name, getattr(saved, name))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The model's weights (save_pretrained when the model has it, otherwise the
        Accelerator's save_model), the processing class and training_args.bin."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        acc = self.accelerator
        unwrapped = acc.unwrap_model(self.model, keep_fp32_wrapper=False, keep_torch_compile=False) \
            if self._prepared_model else self.model
        if hasattr(unwrapped, "save_pretrained"):
            # the weights from the Accelerator (under full sharding a collective every process
            # runs, gathered where they are written; model.state_dict() would refuse), under the
            # names of the model itself (torch.compile's wrapper adds `_orig_mod.`)
            state_dict = acc.get_state_dict(self.model, keep=self._writes())
            if state_dict:
                state_dict = plain_keys(state_dict)
            if self._writes():
                unwrapped.save_pretrained(output_dir, state_dict=state_dict,
                                          safe_serialization=self.args.save_safetensors)
        else:
            acc.save_model(self.model, output_dir, safe_serialization=self.args.save_safetensors)
        if self._writes():
            os.makedirs(output_dir, exist_ok=True)
            if hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        acc.wait_for_everyone()


# ---------------------------------------------------------------------- helpers


def _rng_neutral_start(it):
    """Yields from a data loader iterator whose creation (at the first next()) leaves the global
    torch RNG as it found it: torch's DataLoader draws a base seed when an epoch starts, which
    the interrupted run did before its checkpoint's RNG state was taken."""
    state = torch.random.get_rng_state()
    try:
        first = next(it)
    except StopIteration:
        return
    finally:
        torch.random.set_rng_state(state)
    yield first
    yield from it

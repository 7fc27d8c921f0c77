"""Filling a DeepSpeed config's "auto" values, as accelerate and transformers fill them.

When, and from what:
- building the Accelerator (accelerate: AcceleratorState and `_prepare_deepspeed`; the values
  are known at construction): fp16/bf16 `enabled` from its mixed_precision
  (config_dict.apply_mixed_precision), `gradient_accumulation_steps` from its accumulation steps
  (a concrete value in the config wins, with a warning, as in accelerate), `gradient_clipping`
  with 1.0 (accelerate's value for "auto"), `stage3_gather_16bit_weights_on_model_save` with false;
- `prepare()` (accelerate's `_prepare_deepspeed`): `train_micro_batch_size_per_gpu` from the
  data loaders passed in the same call, `train_batch_size` = micro x accumulation x processes,
  `reduce_bucket_size` from the model's hidden size, the optimizer block's lr/weight_decay from
  the DummyOptim, the scheduler block's warmup/total steps from the DummyScheduler;
- TrainingArguments (transformers' HfTrainerDeepSpeedConfig): batch sizes, accumulation,
  clipping, optimizer lr/betas/eps/weight_decay, warmup_max_lr, fp16/bf16, and at train time
  total/warmup steps; a concrete value disagreeing with an argument is an error listing them all.
"""
from __future__ import annotations

import math
import warnings

from .config_dict import AUTO, auto_paths, fill_auto, get_value, where
from .plugin import is_dummy_optim, is_dummy_scheduler

MICRO = "train_micro_batch_size_per_gpu"
HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")


def fill_at_construction(config: dict, gradient_accumulation_steps: int, source: str | None = None) -> None:
    fill_auto(config, "gradient_accumulation_steps", gradient_accumulation_steps)
    theirs = config.get("gradient_accumulation_steps")
    if theirs != gradient_accumulation_steps:
        warnings.warn(f"Gradient accumulation steps: the Accelerator has {gradient_accumulation_steps}, the DeepSpeed "
                      f"config{where(source)} has {theirs}; using the DeepSpeed config's {theirs} (as accelerate does)",
                      stacklevel=4)
    fill_auto(config, "gradient_clipping", 1.0)
    fill_auto(config, "zero_optimization.stage3_gather_16bit_weights_on_model_save", False)


def micro_batch_size(config: dict, dataloaders, *, split_batches: bool, num_processes: int,
                     is_train_batch_min: bool = True, source: str | None = None):
    """The per-process batch size prepare() fills an "auto" train_micro_batch_size_per_gpu with
    (accelerate's rule: the data loaders of the same prepare() call, the smallest batch unless
    is_train_batch_min=False); the config's own value otherwise (None when absent)."""
    if config.get(MICRO) != AUTO:
        return config.get(MICRO)
    if not dataloaders:
        raise ValueError(f"DeepSpeed config{where(source)}: train_micro_batch_size_per_gpu is 'auto', which prepare() "
                         "fills from the data loaders passed in the same call, and none was passed: pass the "
                         "training (or evaluation) data loader to prepare() together with the model, or set an "
                         "integer train_micro_batch_size_per_gpu in the DeepSpeed config")
    sizes = [getattr(dl, "batch_size", None) for dl in dataloaders]
    if any(s is None for s in sizes):
        raise ValueError(f"DeepSpeed config{where(source)}: train_micro_batch_size_per_gpu is 'auto' but a data loader "
                         "passed to prepare() has batch_size None (it uses a batch_sampler); set an integer "
                         "train_micro_batch_size_per_gpu in the DeepSpeed config")
    if split_batches:
        sizes = [s // num_processes for s in sizes]
    return min(sizes) if is_train_batch_min else max(sizes)


def hidden_size_of(model):
    """The model's hidden size from its config (hidden_size, or the largest of hidden_sizes, also
    under text_config, as transformers looks); None when it has none."""
    cfg = getattr(model, "config", None)
    for node in (cfg, getattr(cfg, "text_config", None)):
        if node is None:
            continue
        if getattr(node, "hidden_size", None) is not None:
            return node.hidden_size
        if getattr(node, "hidden_sizes", None):
            return max(node.hidden_sizes)
    return None


def _hidden_size_for_autos(config: dict, model, source):
    """The model's hidden size when the config has "auto" values filled from it (None when it
    has none); an error naming them when the model has no hidden size."""
    autos = [k for k in HIDDEN_SIZE_KEYS if get_value(config, k) == AUTO]
    if not autos:
        return None
    hidden = hidden_size_of(model)
    if hidden is None:
        raise ValueError(f"DeepSpeed config{where(source)}: {', '.join(autos)} 'auto' are filled from the model's "
                         "config.hidden_size, and the model has none; set integer values for them")
    return hidden


def check_dummies(config: dict, optimizer, scheduler) -> None:
    """accelerate's contract between the config's optimizer/scheduler blocks and what prepare() gets."""
    if optimizer is not None:
        if "optimizer" in config and not is_dummy_optim(optimizer):
            raise ValueError("The DeepSpeed config has an optimizer block, and prepare() got a real optimizer: use one "
                             "of them. Either remove the block, or pass accelerate_c.utils.DummyOptim(params, ...) "
                             "to prepare() to get the optimizer the block describes.")
        if "optimizer" not in config and is_dummy_optim(optimizer):
            raise ValueError("prepare() got a DummyOptim but the DeepSpeed config has no optimizer block to build "
                             "it from: add an optimizer block, or pass a real torch optimizer.")
    if scheduler is not None:
        if "scheduler" in config and not is_dummy_scheduler(scheduler):
            raise ValueError("The DeepSpeed config has a scheduler block, and prepare() got a real scheduler: use one "
                             "of them. Either remove the block, or pass accelerate_c.utils.DummyScheduler(optimizer, "
                             "...) to prepare() to get the scheduler the block describes.")
        if "scheduler" not in config and is_dummy_scheduler(scheduler) and scheduler.lr_scheduler_callable is None:
            raise ValueError("prepare() got a DummyScheduler but the DeepSpeed config has no scheduler block: add a "
                             "scheduler block, or give the DummyScheduler an lr_scheduler_callable.")
    if is_dummy_optim(optimizer) and scheduler is not None and not is_dummy_scheduler(scheduler):
        raise ValueError("With a DummyOptim, the scheduler passed to prepare() must be a DummyScheduler (the real "
                         "optimizer does not exist before prepare()).")


def fill_at_prepare(config: dict, *, dataloaders=(), model=None, optimizer=None, scheduler=None,
                    num_processes: int = 1, split_batches: bool = False, is_train_batch_min: bool = True,
                    source: str | None = None) -> None:
    """accelerate's `_prepare_deepspeed` filling, in place. With a model, every "auto" left is
    an error naming it (accelerate fills the config, then hands it to the engine, at the
    prepare() call that has the model)."""
    micro = micro_batch_size(config, dataloaders, split_batches=split_batches, num_processes=num_processes,
                             is_train_batch_min=is_train_batch_min, source=source)
    values = {}
    if micro is not None:
        values[MICRO] = micro
        values["train_batch_size"] = micro * config["gradient_accumulation_steps"] * num_processes
    check_dummies(config, optimizer, scheduler)
    if model is not None:
        hidden = _hidden_size_for_autos(config, model, source)
        if hidden is not None:
            values.update({HIDDEN_SIZE_KEYS[0]: hidden * hidden, HIDDEN_SIZE_KEYS[1]: int(0.9 * hidden * hidden),
                           HIDDEN_SIZE_KEYS[2]: 10 * hidden})
        if is_dummy_optim(optimizer):
            values.update({"optimizer.params.lr": optimizer.lr,
                           "optimizer.params.weight_decay": optimizer.weight_decay})
        if is_dummy_scheduler(scheduler) and scheduler.lr_scheduler_callable is None:
            opt = scheduler.optimizer
            max_lr = opt.defaults["lr"] if getattr(opt, "defaults", None) is not None else getattr(opt, "lr", None)
            values.update({"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": max_lr,
                           # DeepSpeed's warmup needs at least one step
                           "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps)})
            if scheduler.total_num_steps is not None:
                # a count over the whole data set is steps of all processes together, unless batches are split
                total = scheduler.total_num_steps
                values["scheduler.params.total_num_steps"] = (total if split_batches
                                                              else math.ceil(total / num_processes))
    for path, value in values.items():
        fill_auto(config, path, value)
    left = auto_paths(config)
    if model is not None and left:
        raise ValueError(f"DeepSpeed config{where(source)}: nothing fills 'auto' for {', '.join(left)} (the "
                         "Accelerator fills batch sizes, accumulation, clipping, fp16/bf16, reduce_bucket_size, and "
                         "the optimizer/scheduler blocks from a DummyOptim/DummyScheduler); set values for them")


# ---- TrainingArguments (transformers' rules) ----------------------------------------------------
class _Matcher:
    def __init__(self, config):
        self.config = config
        self.mismatches = []

    def __call__(self, path, value, name=None, must_match=True):
        node_path, _, key = path.rpartition(".")
        node = get_value(self.config, node_path) if node_path else self.config
        if not isinstance(node, dict):
            return
        if node.get(key) == AUTO:
            node[key] = value
        elif must_match and node.get(key) is not None and node[key] != value:
            self.mismatches.append(f"- ds {path}={node[key]} vs TrainingArguments {name}={value}")

    def raise_if_any(self, source):
        if self.mismatches:
            raise ValueError(f"DeepSpeed config{where(source)} values disagree with the TrainingArguments:\n"
                             + "\n".join(self.mismatches) + "\nSet these DeepSpeed config values to 'auto' to take "
                             "the TrainingArguments' values.")


def fill_from_training_args(config: dict, args, world_size: int, source: str | None = None) -> None:
    """What transformers fills from TrainingArguments when they are built (in place)."""
    match = _Matcher(config)
    match(MICRO, args.per_device_train_batch_size, "per_device_train_batch_size")
    match("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    match("train_batch_size", world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps,
          "train_batch_size (world size x per_device_train_batch_size x gradient_accumulation_steps)")
    match("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    match("optimizer.params.lr", args.learning_rate, "learning_rate")
    match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2")
    match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    match("scheduler.params.warmup_min_lr", 0, must_match=False)
    match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if args.save_on_each_node:
        config.setdefault("checkpoint", {})["use_node_local_storage"] = True
    match("fp16.enabled", bool(args.fp16 or getattr(args, "fp16_full_eval", False)), "fp16")
    match("bf16.enabled", bool(args.bf16 or getattr(args, "bf16_full_eval", False)), "bf16")
    match.raise_if_any(source)


def fill_from_training_steps(config: dict, args, model, num_training_steps: int, source: str | None = None) -> None:
    """What transformers fills once the model and the number of training steps are known."""
    match = _Matcher(config)
    hidden = _hidden_size_for_autos(config, model, source)
    if hidden is not None:
        match(HIDDEN_SIZE_KEYS[0], hidden * hidden, must_match=False)
        if get_value(config, "zero_optimization.stage") == 3:
            match(HIDDEN_SIZE_KEYS[1], int(0.9 * hidden * hidden), must_match=False)
            match(HIDDEN_SIZE_KEYS[2], 10 * hidden, must_match=False)
    match("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (computed)")
    match("scheduler.params.warmup_num_steps", args.get_warmup_steps(num_training_steps), "warmup_steps")
    match.raise_if_any(source)

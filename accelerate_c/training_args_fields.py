"""Which of transformers' TrainingArguments fields accelerate_c takes, refuses or carries.

accelerate_c's TrainingArguments (training_args.py) has fields of its own for what its Trainer
and the Accelerator do. transformers' TrainingArguments has many more. Reading one of its
objects or its `to_dict()`, every other field is one of:

- a training-mechanics field (compilation, sharding, precision variants, data order, loss
  shaping, ...) that accelerate_c has not built: accepted at transformers' default value, refused
  by name otherwise (`MECHANICS_AT_DEFAULT`), never silently ignored;
- a field that does not concern the training mechanics (the Hub, trackers, logging levels,
  metrics reporting, ...): carried on the arguments (`TrainingArguments.carried`) and ignored,
  with one warning listing those that are not at their default (`CARRIED_DEFAULTS`, and any
  other field transformers' own dataclass has).
A name that is neither ours nor transformers' is a typo: an error with the nearest name.
Imports nothing of accelerate_c."""
from __future__ import annotations

import dataclasses

# training mechanics not built in accelerate_c: these values only (transformers' defaults, and
# the forms its to_dict() gives them)
MECHANICS_AT_DEFAULT = {
    "torchdynamo": (None,), "jit_mode_eval": (False,), "use_ipex": (False,),
    "fsdp_min_num_params": (0,), "fsdp_transformer_layer_cls_to_wrap": (None,), "parallelism_config": (None,),
    "ddp_static_graph": (None, False), "ddp_backend_kwargs": (None,),
    "split_batches": (None,), "dispatch_batches": (None,),
    "tf32": (None,), "half_precision_backend": ("auto",), "fp16_opt_level": ("O1",), "bf16_full_eval": (False,),
    "fp16_full_eval": (False,), "use_mps_device": (False,), "local_rank": (-1,), "tpu_num_cores": (None,),
    "mp_parameters": ("",), "debug": ("", [], None),
    "activation_checkpointing": (None, False), "activation_checkpointing_kwargs": (None,),
    "gradient_checkpointing_kwargs": (None,),
    "dataloader_multiprocessing_context": (None,), "dataloader_in_order": (True,),
    "group_by_length": (False,),
    "ignore_data_skip": (False,), "auto_find_batch_size": (False,), "torch_empty_cache_steps": (None,),
    "average_tokens_across_devices": (True, False), "past_index": (-1,),
    "optim_args": (None,), "adafactor": (False,), "neftune_noise_alpha": (None,), "optim_target_modules": (None,),
    "use_liger_kernel": (False,), "liger_kernel_config": (None,),
    "eval_delay": (0, 0.0, None), "include_inputs_for_metrics": (False,), "include_for_metrics": ([], None),
    "batch_eval_metrics": (False,), "eval_do_concat_batches": (True,), "eval_use_gather_object": (False,),
    "use_legacy_prediction_loop": (False,), "restore_callback_states_from_checkpoint": (False,),
    "enable_jit_checkpoint": (False,),
}

# fields of older transformers that 5.23 no longer has (its TrainingArguments refuses them): why
REPLACED = {"group_by_length": "transformers 5 replaced it (5.23's TrainingArguments has no such field): use "
                               "train_sampling_strategy='group_by_length'"}

# not training mechanics: carried and ignored; listed in the warning when not at these values
CARRIED_DEFAULTS = {
    "do_predict": (False,), "push_to_hub": (False,), "hub_model_id": (None,), "hub_strategy": ("every_save",),
    "hub_token": (None,), "hub_private_repo": (None, False), "hub_always_push": (False,), "hub_revision": (None,),
    "hub_private": (None,), "ray_scope": ("last",), "project": (None, "huggingface"), "trackio_space_id": (None,),
    "trackio_bucket_id": (None,), "trackio_static_space_id": (None,), "include_tokens_per_second": (False,),
    "include_num_input_tokens_seen": (False, "no"), "log_level": ("passive",), "log_level_replica": ("warning",),
    "log_on_each_node": (True,), "skip_memory_metrics": (True,), "use_cache": (False, None),
}

# the forms an empty list-like field takes (transformers' "" / [] / None for `debug` and
# `include_for_metrics`); False and 0 are values of their own (tf32=False disables TF32)
_EMPTY = (None, "", (), [], {})


def transformers_defaults() -> dict:
    """transformers' TrainingArguments field defaults when transformers is installed, else {}."""
    try:
        import transformers
    except ImportError:
        return {}
    out = {}
    for f in dataclasses.fields(transformers.TrainingArguments):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _at(value, allowed) -> bool:
    if isinstance(value, str) and value.startswith("<") and value.endswith(">"):
        return True  # a secret to_dict() redacted ("<HUB_TOKEN>"): its value is not known
    value = getattr(value, "value", value)  # a transformers enum member

    def same(a):
        if isinstance(value, bool) or isinstance(a, bool) or value is None or a is None:
            return value is a or (_empty(value) and _empty(a) and not isinstance(value, bool)
                                  and not isinstance(a, bool))
        return value == a or (_empty(value) and _empty(a))
    return any(same(a) for a in allowed)


def _empty(v) -> bool:
    return v is None or (isinstance(v, (str, tuple, list, dict)) and len(v) == 0)


def classify(name: str, value, hf_defaults: dict):
    """("refuse", why) | ("carry", listed: bool) | ("unknown", None) for a field that is not
    one of accelerate_c's."""
    if name in MECHANICS_AT_DEFAULT:
        allowed = MECHANICS_AT_DEFAULT[name]
        if _at(value, allowed):
            return "carry", False
        if name in REPLACED:
            return "refuse", REPLACED[name]
        return "refuse", f"not supported yet by accelerate_c; leave it at {allowed[0]!r}"
    if name in CARRIED_DEFAULTS:
        return "carry", not _at(value, CARRIED_DEFAULTS[name])
    if name in hf_defaults:
        return "carry", not _at(value, (hf_defaults[name],))
    return "unknown", None


def is_transformers_args(obj) -> bool:
    """Whether obj is a transformers.TrainingArguments (or a subclass, e.g. Seq2SeqTrainingArguments),
    recognised without importing transformers."""
    return any(c.__name__ == "TrainingArguments" and c.__module__.split(".")[0] == "transformers"
               for c in type(obj).__mro__) and callable(getattr(obj, "to_dict", None))

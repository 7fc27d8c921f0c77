"""torch.compile of a prepared model, as accelerate's dynamo plugin does it.

With a TorchDynamoPlugin whose backend is not NO (the `dynamo_backend` argument, the config
file's `dynamo_config`, transformers' `torch_compile`), prepare() compiles the model last, after
its forward was wrapped (autocast, fp32 outputs) and its gradients were given their buffers or
shards: the compiled region runs the wrapped forward, and the hooks sit on the parameters the
compiled module shares with the model. The model stays registered uncompiled (as accelerate's
`_models` keeps it): checkpoints and the gradient machinery see the user's module;
`prepared_inner` maps the compiled wrapper the user holds back to it.

Regional compilation (`use_regional_compilation`: utils.other.compile_regions) compiles each
block of a list of blocks of one class on its own, and the rest of the model whole.
"""
from __future__ import annotations

import torch

from .utils.other import compile_regions, has_repeated_blocks, is_compiled_module, is_repeated_blocks


def _compile_in_place(module: torch.nn.Module, regional: bool, kwargs: dict) -> None:
    if not regional or not has_repeated_blocks(module):
        module.compile(**kwargs)
    elif is_repeated_blocks(module):
        for block in module:
            block.compile(**kwargs)
    else:
        for child in module.children():
            _compile_in_place(child, True, kwargs)


def compile_prepared(model: torch.nn.Module, plugin, in_place: bool = False) -> torch.nn.Module:
    """The prepared `model` compiled as the dynamo plugin says, or `model` itself (backend NO,
    or compiled already). `in_place` (the DeepSpeed settings, where accelerate compiles the
    engine's module itself): `Module.compile`, the model stays the object the user holds and its
    state dict keeps its keys; else torch.compile's wrapper (or regional twins), whose state dict
    keys carry `_orig_mod`, as accelerate's do."""
    if plugin is None or str(getattr(plugin.backend, "value", plugin.backend)).upper() == "NO":
        return model
    if is_compiled_module(model) or getattr(model, "_compiled_call_impl", None) is not None:
        return model
    kwargs = plugin.to_kwargs()
    try:
        if in_place:
            _compile_in_place(model, bool(plugin.use_regional_compilation), kwargs)
            return model
        if plugin.use_regional_compilation:
            return compile_regions(model, **kwargs)  # (its twins share the model's instance dict)
        compiled = torch.compile(model, **kwargs)
    except Exception as e:  # an unknown or unavailable backend: torch's error says which
        if hasattr(e, "add_note"):
            e.add_note(f"(accelerate_c: prepare() compiling the model with the dynamo plugin's settings {kwargs})")
        raise
    if "zero_grad" in model.__dict__:
        # the sharding strategies' model.zero_grad (it clears the gradient shards too,
        # strategies/zero2.py): the wrapper's would only reach the parameters' .grad
        compiled.zero_grad = model.__dict__["zero_grad"]
    return compiled


def prepared_inner(model):
    """The module torch.compile wrapped when `model` is its wrapper (whole, or compiled regions
    keeping `_orig_mod`); else None."""
    if is_compiled_module(model):
        return model._orig_mod
    if isinstance(model, torch.nn.Module):
        return model.__dict__.get("_orig_mod")
    return None

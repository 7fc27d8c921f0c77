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

import weakref

import torch

from .utils.other import compile_regions, compile_regions_in_place, is_compiled_module


# the wrappers and regional twins prepare() made -> the model inside (weakly: a wrapper the user
# drops goes); survives free_memory(), so preparing such a wrapper again prepares its model
_MADE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiles(model: torch.nn.Module, plugin) -> bool:
    """Whether compile_prepared(model, plugin) compiles it (not backend NO, not compiled yet)."""
    return str(getattr(plugin.backend, "value", plugin.backend)).upper() != "NO" and not is_compiled_module(model)


def compile_prepared(model: torch.nn.Module, plugin, in_place: bool = False) -> torch.nn.Module:
    """The prepared `model` compiled as the dynamo plugin says, or `model` itself (backend NO,
    or torch.compile's wrapper already). `in_place` (the DeepSpeed settings, where accelerate
    compiles the engine's module itself, and FSDP's regional compilation): `Module.compile` (of
    each repeated block when regional), the model stays the object the user holds and its state
    dict keeps its keys; else torch.compile's wrapper (or regional twins), whose state dict keys
    carry `_orig_mod`, as accelerate's do."""
    if not compiles(model, plugin):
        return model
    kwargs = plugin.to_kwargs()
    try:
        if in_place:
            if plugin.use_regional_compilation:
                compile_regions_in_place(model, **kwargs)
            else:
                model.compile(**kwargs)
            return model
        if plugin.use_regional_compilation:
            compiled = compile_regions(model, **kwargs)
        else:
            compiled = torch.compile(model, **kwargs)
    except Exception as e:  # an unknown or unavailable backend: torch's error says which
        if hasattr(e, "add_note"):
            e.add_note(f"(accelerate_c: prepare() compiling the model with the dynamo plugin's settings {kwargs})")
        raise

    # the wrapper's zero_grad is the model's, looked up at each call: a sharding strategy's
    # (strategies/zero2.py: it clears the gradient shards too) may be installed after this, when
    # the model was prepared for evaluation first; the wrapper's own would only reach .grad
    def zero_grad(set_to_none: bool = True) -> None:
        model.zero_grad(set_to_none)

    compiled.zero_grad = zero_grad
    _MADE[compiled] = model
    return compiled


def made_by_prepare(model):
    """The model inside `model` when `model` is a wrapper (or regional twin) prepare() made;
    else None."""
    return _MADE.get(model)


def prepared_inner(model):
    """The module torch.compile wrapped when `model` is its wrapper (whole, or compiled regions
    keeping `_orig_mod`); else None."""
    if is_compiled_module(model):
        return model._orig_mod
    if isinstance(model, torch.nn.Module):
        return model.__dict__.get("_orig_mod")
    return None


def plain_keys(state_dict: dict) -> dict:
    """`state_dict` with the `_orig_mod` components torch.compile's wrapper (and regional twins)
    add to the keys removed: the names of the user's model, which from_pretrained and
    load_state_dict on it expect."""
    if not any("_orig_mod." in k for k in state_dict):
        return state_dict
    return {".".join(part for part in k.split(".") if part != "_orig_mod"): v for k, v in state_dict.items()}

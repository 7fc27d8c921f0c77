"""accelerate.utils' model unwrapping: `extract_model_from_parallel`, which transformers'
`unwrap_model` (and so its checkpoint saving) calls on the Trainer's model."""
from __future__ import annotations

import torch
from torch import nn


def _containers() -> tuple:
    """The wrapper classes that hold the user's model as `.module`."""
    kinds = [nn.parallel.DistributedDataParallel, nn.DataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        kinds.append(FullyShardedDataParallel)
    except ImportError:  # torch built without distributed
        pass
    return tuple(kinds)


def is_compiled_module(module) -> bool:
    """Whether `module` is torch.compile's wrapper (an OptimizedModule) of another module."""
    compiled = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    kind = getattr(compiled, "OptimizedModule", None)
    return kind is not None and isinstance(module, kind)


def _drop_fp32_wrapper(model):
    """The model's own forward back in place of the autocast / fp32-output one that prepare()
    installed (kept as `_original_forward` in the instance)."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    model.forward = original
    if getattr(original, "__self__", None) is model and \
            getattr(original, "__func__", None) is getattr(type(model), "forward", None):
        del model.forward  # the class's forward again, as before prepare()


def _unwrap_children(module):
    while hasattr(module, "module") and isinstance(module.module, nn.Module):
        module = module.module
    for name, child in list(module.named_children()):
        setattr(module, name, _unwrap_children(child))
    return module


def extract_model_from_parallel(model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False):
    """The user's model out of its distributed containers (DDP, DataParallel, FSDP; accelerate_c
    itself wraps nothing), as accelerate 1.15 does:
    - torch.compile's wrapper is looked through; with keep_torch_compile it is returned around
      the unwrapped model, else the inner model is;
    - keep_fp32_wrapper=False restores the forward prepare() replaced under mixed precision;
    - recursive also unwraps every submodule held as `.module` by a container."""
    compiled, whole = None, False
    if is_compiled_module(model):
        compiled, model, whole = model, model._orig_mod, True
    elif isinstance(model, nn.Module) and "_orig_mod" in model.__dict__:  # compiled regions only
        compiled, model = model, model.__dict__["_orig_mod"]
    kinds = _containers()
    while isinstance(model, kinds):
        model = model.module
    if recursive:
        model = _unwrap_children(model)
    if not keep_fp32_wrapper:
        _drop_fp32_wrapper(model)
    if keep_torch_compile and compiled is not None:
        if whole:
            compiled._orig_mod = model
        else:
            compiled.__dict__["_orig_mod"] = model
        return compiled
    return model

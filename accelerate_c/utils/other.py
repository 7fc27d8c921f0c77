"""accelerate.utils' model unwrapping and compiling: `extract_model_from_parallel`, which
transformers' `unwrap_model` (and so its checkpoint saving) calls on the Trainer's model, and
regional compilation (`compile_regions`, what the dynamo plugin's use_regional_compilation does
in prepare())."""
from __future__ import annotations

from types import MethodType

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
        if compiled is not None:  # a model compiled before prepare(): the wrapper is the compiled one's
            _drop_fp32_wrapper(compiled)
    if keep_torch_compile and compiled is not None:
        if whole:
            compiled._orig_mod = model
        else:
            compiled.__dict__["_orig_mod"] = model
        return compiled
    return model


def is_repeated_blocks(module: torch.nn.Module) -> bool:
    """A non-empty ModuleList whose members are all of its first member's class."""
    if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
        return False
    kind = type(module[0])
    return all(isinstance(m, kind) for m in module)


def has_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether `module` or anything below it is a list of repeated blocks."""
    return any(is_repeated_blocks(m) for m in module.modules())


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether a submodule of `module` (or `module` itself) is torch.compile's wrapper."""
    return bool(module._modules) and any(is_compiled_module(m) for m in module.modules())


def _twin(module: torch.nn.Module, compile_kwargs: dict) -> torch.nn.Module:
    if is_repeated_blocks(module):
        return torch.nn.ModuleList(torch.compile(block, **compile_kwargs) for block in module)
    if not has_repeated_blocks(module):
        return torch.compile(module, **compile_kwargs)
    twin = type(module).__new__(type(module))
    twin.__dict__.update(module.__dict__)  # the same parameter, buffer and hook dicts
    for name, value in list(twin.__dict__.items()):
        # methods bound to the original in its instance dict (prepare()'s forward) bind to the twin
        if getattr(value, "__self__", None) is module and hasattr(value, "__func__"):
            twin.__dict__[name] = MethodType(value.__func__, twin)
    twin._modules = {}
    for name, child in module.named_children():
        twin.add_module(name, _twin(child, compile_kwargs))
    return twin


def compile_regions(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """`module` with each block of its lists of repeated blocks compiled on its own (the
    compiler's cache serves every block after the first) and the rest whole, as accelerate's
    compile_regions: the modules above such a list become shallow twins whose children are their
    compiled versions; the result keeps `module` as `_orig_mod` (how unwrapping finds it)."""
    out = _twin(module, compile_kwargs)
    if "_orig_mod" not in out.__dict__:
        out.__dict__["_orig_mod"] = module
    return out


def compile_regions_in_place(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """compile_regions with `Module.compile` (in place: the module stays the object its hooks
    and its holders know), as accelerate compiles DeepSpeed's module and FSDP2's regions."""
    if is_repeated_blocks(module):
        for block in module:
            block.compile(**compile_kwargs)
    elif has_repeated_blocks(module):
        for child in module.children():
            compile_regions_in_place(child, **compile_kwargs)
    else:
        module.compile(**compile_kwargs)
    return module

"""Rewrites one of accelerate's own test scripts (from the installed accelerate wheel) so that
it tests accelerate_c: every `from accelerate... import X` takes X from accelerate_c.

Rules, per imported name (the rewritten file keeps the original's line numbers, so tracebacks
point at the wheel's source lines):

- names from `accelerate.test_utils...` (RegressionModel, RegressionDataset,
  assert_exception...) stay accelerate's: they are test fixtures, not the library under test;
  except are_the_same_tensors, which reads accelerate's own state and so comes from
  wheel_fixtures.py (the same check on plain torch.distributed);
- the `is_*_available` machine probes (is_cuda_available, is_datasets_available...) come from
  accelerate_c.utils like the rest: it has every one accelerate 1.15 exports, with the same
  answers (tests/test_probes.py);
- everything else (Accelerator, the states, DataLoaderConfiguration, gather, set_seed...) comes
  from accelerate_c: the same module path under accelerate_c if it has the name there, else
  accelerate_c.utils (for accelerate.utils.*), else accelerate_c itself;
- a name accelerate_c does not provide becomes a stand-in that raises NotImplementedError
  when used, so only the test functions that use it fail (the script still imports).

Nothing is copied into the repository: the rewritten text is generated from the wheel at
test time (accelerate==1.15.0 is pinned in requirements-dev.txt).
"""
from __future__ import annotations

import ast
import importlib
import os

# fixtures of accelerate.test_utils replaced by wheel_fixtures.py (see there why)
_FIXTURE_OVERRIDES = {"are_the_same_tensors"}


def wheel_scripts_dir() -> str:
    """accelerate's test scripts as installed with the pinned wheel."""
    import accelerate.test_utils

    return os.path.join(os.path.dirname(accelerate.test_utils.__file__), "scripts")


def wheel_script(name: str) -> str:
    path = os.path.join(wheel_scripts_dir(), name if name.endswith(".py") else name + ".py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"accelerate test script {name!r} not found at {path}")
    return path


class Missing:
    """Stands in for a name accelerate_c lacks: any use raises NotImplementedError."""

    def __init__(self, qualname: str):
        object.__setattr__(self, "_qualname", qualname)

    def _fail(self, *args, **kwargs):
        raise NotImplementedError(f"accelerate_c does not provide {self._qualname}")

    __call__ = _fail

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._fail()

    def __repr__(self):
        return f"<missing in accelerate_c: {self._qualname}>"


def missing(qualname: str) -> Missing:
    return Missing(qualname)


def _candidates(module: str):
    tail = module[len("accelerate"):]  # "" or ".utils.operations"...
    out = ["accelerate_c" + tail]
    if tail.startswith(".utils"):
        out.append("accelerate_c.utils")
    out.append("accelerate_c")
    seen = []
    for c in out:
        if c not in seen:
            seen.append(c)
    return seen


def resolve(module: str, name: str):
    """Where the rewritten script takes `name` (imported from accelerate's `module`) from:
    ("accelerate", module) for test fixtures, ("accelerate_c", module_c) when
    accelerate_c provides it, ("missing", None) otherwise."""
    if module.startswith("accelerate.test_utils") and name in _FIXTURE_OVERRIDES:
        return "fixture", "wheel_fixtures"
    if module.startswith("accelerate.test_utils"):
        return "accelerate", module
    for cand in _candidates(module):
        try:
            mod = importlib.import_module(cand)
        except ImportError:
            continue
        if hasattr(mod, name):
            return "accelerate_c", cand
    return "missing", None


def rewrite_source(src: str):
    """Returns (rewritten source, mapping) where mapping lists (module, name, where, source)."""
    tree = ast.parse(src)
    lines = src.splitlines(keepends=True)
    edits = []
    mapping = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name == "accelerate" or a.name.startswith("accelerate.") for a in node.names):
                raise ValueError(f"line {node.lineno}: `import accelerate...` is not supported by the rewriter")
            continue
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module != "accelerate" and not node.module.startswith("accelerate."):
            continue
        stmts = []
        for alias in node.names:
            if alias.name == "*":
                raise ValueError(f"line {node.lineno}: star imports are not supported by the rewriter")
            bind = alias.asname or alias.name
            where, src_mod = resolve(node.module, alias.name)
            mapping.append((node.module, alias.name, where, src_mod))
            if where == "missing":
                stmts.append(f"from rewrite import missing as _ac_missing; "
                             f"{bind} = _ac_missing({node.module + '.' + alias.name!r})")
            else:
                stmts.append(f"from {src_mod} import {alias.name}" + (f" as {bind}" if bind != alias.name else ""))
        edits.append((node.lineno, node.end_lineno, node.col_offset, "; ".join(stmts)))
    for start, end, col, text in sorted(edits, reverse=True):
        indent = lines[start - 1][:col]
        blank = ["\n"] * (end - start)  # keep the line count: tracebacks match the wheel's file
        lines[start - 1:end] = [indent + text + "\n"] + blank
    return "".join(lines), mapping


def rewrite_file(script: str, out_dir: str):
    """Writes the rewritten `script` (a wheel script name or path) into out_dir; returns
    (path, mapping). Missing names import `missing` from this module (`rewrite`), so this
    directory must be on sys.path when the rewritten script is imported."""
    path = script if os.path.isfile(script) else wheel_script(script)
    with open(path) as f:
        src = f.read()
    new, mapping = rewrite_source(src)
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, os.path.basename(path))
    with open(out, "w") as f:
        f.write(new)
    return out, mapping


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        _, mp = rewrite_source(open(wheel_script(arg)).read())
        for module, name, where, src in mp:
            print(f"{arg}: {module}.{name} -> {where}{'' if src is None else ' (' + src + ')'}")

"""accelerate_c.utils' machine probes against accelerate 1.15's, asked side by side in the same
process: every is_*_available accelerate exports exists in accelerate_c.utils and gives the
same truth value, as the machine is, with arguments, and with packages made to look absent or
present (both packages read the same importlib state)."""
import importlib.metadata
import importlib.util

import pytest

import accelerate_c.utils as ours

theirs = pytest.importorskip("accelerate.utils")

NAMES = sorted(n for n in dir(theirs) if n.startswith("is_") and n.endswith("_available"))


def _clear_caches():
    for mod in (ours, theirs):
        for n in NAMES:
            clear = getattr(getattr(mod, n), "cache_clear", None)
            if clear is not None:
                clear()


def _same_everywhere():
    _clear_caches()
    diffs = {n: (getattr(theirs, n)(), getattr(ours, n)()) for n in NAMES}
    return {n: v for n, v in diffs.items() if bool(v[0]) != bool(v[1])}


def test_every_probe_accelerate_exports_exists_and_answers_alike():
    assert len(NAMES) > 40  # the list was read from accelerate
    assert [n for n in NAMES if not hasattr(ours, n)] == []
    assert _same_everywhere() == {}
    for n in NAMES:
        assert isinstance(getattr(ours, n)(), bool), n


def test_probes_that_take_arguments():
    _clear_caches()
    calls = [("is_bf16_available", (True,)), ("is_bnb_available", ("0.1",)), ("is_mps_available", ("1.12",)),
             ("is_mps_available", ("99.0",)), ("is_torch_xla_available", (True, False)),
             ("is_torch_xla_available", (False, True)), ("is_npu_available", (True,)),
             ("is_xpu_available", (True,)), ("is_hpu_available", (False,))]
    for name, args in calls:
        assert bool(getattr(ours, name)(*args)) == bool(getattr(theirs, name)(*args)), (name, args)


@pytest.mark.parametrize("hidden", ["datasets", "torchdata", "transformers", "pytest"])
def test_a_package_made_absent_is_absent_for_both(hidden, monkeypatch):
    # the machine has them (requirements-dev.txt): both say so, then neither once it is hidden
    assert getattr(ours, f"is_{hidden}_available")() is True
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] == hidden else real(name, *a, **k))
    assert getattr(ours, f"is_{hidden}_available")() is False
    assert _same_everywhere() == {}


def test_a_package_without_metadata_or_too_old(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.7.0" if d == "torchdata" else real(d))
    assert ours.is_torchdata_available() is True
    assert ours.is_torchdata_stateful_dataloader_available() is False
    assert _same_everywhere() == {}
    real_md = importlib.metadata.metadata

    def no_md(d):
        if d == "datasets":
            raise importlib.metadata.PackageNotFoundError(d)
        return real_md(d)
    monkeypatch.setattr(importlib.metadata, "metadata", no_md)
    assert ours.is_datasets_available() is False
    assert _same_everywhere() == {}


@pytest.mark.parametrize("env", [{"ACCELERATE_ENABLE_RICH": "1"}, {"USE_TORCH_XLA": "0"},
                                 {"ACCELERATE_USE_MEGATRON_LM": "true"}])
def test_probes_read_the_same_environment(env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _same_everywhere() == {}

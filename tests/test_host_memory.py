"""glibc's malloc settings: an Accelerator leaves them alone unless asked (HostMallocKwargs,
ACCELERATE_C_MALLOC_TUNING=1). Each case runs in a fresh process, since the settings are
process-wide and cannot be undone, and is judged by glibc's behaviour, not by our code: 256 MiB
of small blocks are allocated, touched and freed from the main heap; with glibc's defaults
(trim threshold at most 64 MiB) the heap's top is given back to the kernel, with the tuning
(1 GiB) it stays."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import accelerate_c
from accelerate_c import Accelerator, HostMallocKwargs, host_malloc
from timeouts import wait_s

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                                reason="the malloc settings are glibc's")

PROBE = r"""
import ctypes, json, os, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
mode = sys.argv[1]
if mode != "none":  # the control needs no torch
    import accelerate_c
if mode == "accelerator":
    accelerate_c.Accelerator(cpu=True)
elif mode in ("handler", "handler_off"):
    accelerate_c.Accelerator(cpu=True, kwargs_handlers=[accelerate_c.HostMallocKwargs(enabled=mode == "handler")])
statm, page = os.open("/proc/self/statm", os.O_RDONLY), os.sysconf("SC_PAGE_SIZE")
def rss():  # no allocation from the heap (a fresh open() would leave some above the blocks)
    return int(os.pread(statm, 200, 0).split()[1]) * page
rss(), libc.mallinfo2()  # warm: their first calls may allocate and keep memory
# 64 KiB blocks: below any mmap threshold, so they come from the main heap (this thread's
# arena); nothing allocated meanwhile may stay above them, or the top could not shrink
N, SIZE = 4096, 64 << 10
ptrs = (ctypes.c_void_p * N)()
before, rss0 = libc.mallinfo2().arena, rss()
for i in range(N):
    ptrs[i] = libc.malloc(SIZE)
    ctypes.memset(ptrs[i], 1, SIZE)
peak, rss1 = libc.mallinfo2().arena, rss()
for i in reversed(range(N)):
    libc.free(ptrs[i])
print(json.dumps({"before": before, "peak": peak, "after": libc.mallinfo2().arena, "rss_peak": rss1 - rss0,
                  "rss_after": rss() - rss0}))
"""

MALLOC_VARS = tuple(host_malloc.GLIBC_ENV) + ("GLIBC_TUNABLES", host_malloc.ENV)


def probe(mode: str, **env) -> dict:
    """The heap's size (glibc's mallinfo2().arena) and RSS after the probe's blocks are freed,
    in a fresh process: `mode` "none" (no Accelerator), "accelerator" (Accelerator(cpu=True)),
    "handler" / "handler_off" (with HostMallocKwargs(enabled=True / False)); `env` on top of an
    environment without any malloc setting."""
    base = {k: v for k, v in os.environ.items() if k not in MALLOC_VARS}
    res = subprocess.run([sys.executable, "-c", PROBE, mode], env={**base, **env}, capture_output=True, text=True,
                         timeout=wait_s(180))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["peak"] - out["before"] >= 250 << 20, out  # the blocks did come from the heap
    return out


def kept(out: dict) -> bool:
    """Whether the freed 256 MiB stayed in the heap (tuned) rather than being trimmed."""
    return out["after"] - out["before"] >= 200 << 20


@glibc_only
def test_a_default_accelerator_leaves_glibc_malloc_untouched():
    out = probe("accelerator")
    assert not kept(out), f"the heap kept {(out['after'] - out['before']) >> 20} MiB after free: {out}"
    # and the process really gave the memory back
    assert out["rss_after"] < out["rss_peak"] - (128 << 20), out


@glibc_only
def test_the_probe_sees_tuning_set_by_glibcs_own_variables():
    """The control: the MALLOC_*_ variables docs/performance.md gives for torch alone set what
    the opt-in sets, and the probe tells (no Accelerator at all)."""
    env = {k: str(v) for k, v in host_malloc.GLIBC_ENV.items()}
    assert not kept(probe("none"))
    out = probe("none", **env)
    assert kept(out), out
    assert out["rss_after"] > out["rss_peak"] - (16 << 20), out  # RSS stays at the peak


@glibc_only
@pytest.mark.parametrize("mode, env, tuned", [
    ("accelerator", {host_malloc.ENV: "1"}, True),
    ("accelerator", {host_malloc.ENV: "0"}, False),
    ("handler", {}, True),
    ("handler", {host_malloc.ENV: "0"}, True),  # the handler decides
    ("handler_off", {host_malloc.ENV: "1"}, False),
], ids=["env-1", "env-0", "handler", "handler-over-env-0", "handler-off-over-env-1"])
def test_the_opt_in_applies_glibc_malloc_settings(mode, env, tuned):
    out = probe(mode, **env)
    assert kept(out) == tuned, out


PAGES_PER_ROUND = 4 * 30 * (1 << 20) // 4096  # 4 blocks of 30 MiB, like one step's activations

FAULTS = r"""
import ctypes, resource, torch, accelerate_c
# one fault per 4 KiB page, whatever the host's transparent-huge-page setting ("always" would
# fault the untuned blocks in 2 MiB at a time): PR_SET_THP_DISABLE
ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)
accelerate_c.Accelerator(cpu=True)
def step():  # a "step" that allocates, touches and frees the same memory
    ts = [torch.empty(30 << 18).fill_(1.0) for _ in range(4)]
    del ts
step()  # the first one faults its memory in either way (and torch's first-use pages with it)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(9):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def faults_with(**env) -> int:
    base = {k: v for k, v in os.environ.items() if k not in MALLOC_VARS}
    res = subprocess.run([sys.executable, "-c", FAULTS], env={**base, **env}, capture_output=True, text=True,
                         timeout=wait_s(180))
    assert res.returncode == 0, res.stderr[-2000:]
    return int(res.stdout.split()[-1])


@glibc_only
def test_the_opt_in_reuses_freed_tensor_memory_without_faulting_it_in_again():
    # the nine steps after a first one: its faults (and torch's first-use pages, which made a bound
    # on all ten steps flaky: 11 pages over it once) are not counted
    untuned, tuned = faults_with(), faults_with(**{host_malloc.ENV: "1"})
    # glibc's defaults give the blocks back and fault them in again: every round in most runs,
    # or (when its dynamic threshold has caught up) still a second and a third time
    assert untuned > PAGES_PER_ROUND, untuned
    # tuned: the memory of the first step is reused by the nine others (measured: 7680 to 15360
    # pages, a quarter to half a step's, against 38365 to 276189 untuned)
    assert tuned < 0.75 * PAGES_PER_ROUND and 2 * tuned < untuned, (tuned, untuned)


@pytest.mark.parametrize("value", ["yes", "2", "on"])
def test_a_bad_malloc_tuning_value_names_the_variable_and_the_value(monkeypatch, value):
    monkeypatch.setenv(host_malloc.ENV, value)
    with pytest.raises(ValueError, match=f"ACCELERATE_C_MALLOC_TUNING='{value}'"):
        Accelerator(cpu=True)
    # checked even when a handler decides
    with pytest.raises(ValueError, match=f"ACCELERATE_C_MALLOC_TUNING='{value}'"):
        Accelerator(cpu=True, kwargs_handlers=[HostMallocKwargs(enabled=False)])


def test_one_host_malloc_handler_only():
    with pytest.raises(ValueError, match="only pass one HostMallocKwargs"):
        Accelerator(cpu=True, kwargs_handlers=[HostMallocKwargs(enabled=False), HostMallocKwargs(enabled=False)])


def test_the_handler_is_kept_and_exported(monkeypatch):
    monkeypatch.delenv(host_malloc.ENV, raising=False)
    handler = HostMallocKwargs(enabled=False)
    acc = Accelerator(cpu=True, kwargs_handlers=[handler])
    assert acc.host_malloc_handler is handler
    assert Accelerator(cpu=True).host_malloc_handler is None
    assert accelerate_c.utils.HostMallocKwargs is HostMallocKwargs and "HostMallocKwargs" in accelerate_c.__all__
    assert HostMallocKwargs().to_kwargs() == {} and handler.to_kwargs() == {"enabled": False}


def test_requested_follows_the_handler_then_the_variable(monkeypatch):
    monkeypatch.delenv(host_malloc.ENV, raising=False)
    assert not host_malloc.requested(None)
    assert host_malloc.requested(HostMallocKwargs())
    monkeypatch.setenv(host_malloc.ENV, "1")
    assert host_malloc.requested(None)
    assert not host_malloc.requested(HostMallocKwargs(enabled=False))
    monkeypatch.setenv(host_malloc.ENV, " ")
    assert not host_malloc.requested(None)

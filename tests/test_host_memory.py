"""Host memory around a training step: glibc keeps freed tensor memory for the next step once
an Accelerator exists (ACCELERATE_C_MALLOC_TUNING, on by default), measured in page faults
against the same allocations in a process where it is off."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from accelerate_c import Accelerator
from timeouts import wait_s

PAGES_PER_ROUND = 4 * 30 * (1 << 20) // 4096  # 4 blocks of 30 MiB, like one step's activations

SCRIPT = r"""
import ctypes, resource, torch, accelerate_c
# one fault per 4 KiB page, whatever the host's transparent-huge-page setting ("always" would
# fault the untuned blocks in 2 MiB at a time): PR_SET_THP_DISABLE
ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)
accelerate_c.Accelerator(cpu=True)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # ten "steps" that allocate, touch and free the same memory
    ts = [torch.empty(30 << 18).fill_(1.0) for _ in range(4)]
    del ts
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def faults_with(value: str) -> int:
    env = dict(os.environ, ACCELERATE_C_MALLOC_TUNING=value)
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=wait_s(120))
    assert res.returncode == 0, res.stderr[-2000:]
    return int(res.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="the malloc settings are glibc's")
def test_freed_tensor_memory_is_reused_without_faulting_it_in_again():
    untuned, tuned = faults_with("0"), faults_with("1")
    # glibc's defaults give the blocks back and fault them in again: every round in most runs,
    # or (when its dynamic threshold has caught up) still a second and a third time
    assert untuned > 2 * PAGES_PER_ROUND, untuned
    # tuned: the first round faults its memory in, the other nine reuse it
    assert tuned < 1.5 * PAGES_PER_ROUND, (tuned, untuned)


def test_a_bad_malloc_tuning_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_C_MALLOC_TUNING", "yes")
    with pytest.raises(ValueError, match="ACCELERATE_C_MALLOC_TUNING='yes'"):
        Accelerator(cpu=True)

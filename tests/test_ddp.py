"""Gradient synchronisation on several processes: real processes through the real launcher."""
import os

import pytest

from test_launch import SCRIPTS, launch
from timeouts import wait_s


@pytest.mark.parametrize("n", [2, 3])
def test_n_ranks_match_one_process_with_n_times_the_batch(n):
    res = launch(["--num_processes", str(n), "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "ddp_equivalence.py")], timeout=wait_s(600))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert f"ddp equivalence OK on {n} processes" in res.stdout


def test_a_rank_that_raises_mid_step_ends_the_job_with_an_error():
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "faults.py"), "raise"], timeout=wait_s(120))
    assert res.returncode != 0
    assert "rank failure injected by the test" in res.stderr


def test_collective_timeout_raises_instead_of_hanging():
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "faults.py"), "timeout"], timeout=wait_s(120),
                 env={"FAULT_TIMEOUT_S": str(wait_s(1))})
    assert "rank 0 timed out as expected" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]
    # the error names the rank and the bucket (and its parameters)
    assert "rank 0/2: the all-reduce of gradient bucket 0" in res.stdout, res.stdout[-2000:]
    assert "weight" in res.stdout.split("gradient bucket 0", 1)[1]
    assert res.returncode != 0


@pytest.mark.parametrize("n", [2, 3])
def test_bucketed_reducer_matches_torch_ddp(n):
    """tests/scripts/reducer.py: torch DDP agreement, the bucket plan (caps, re-layout in arrival
    order, identical on all ranks, launched during backward), raw loss.backward(), no_sync, two
    backwards in a step, unused parameters, 16-bit comm hooks, broadcast_buffers, PowerSGD."""
    res = launch(["--num_processes", str(n), "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "reducer.py")], timeout=wait_s(600))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert f"reducer OK on {n} processes" in res.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_control_flow_that_differs_between_ranks_over_two_gradient_groups_matches_torch_ddp(n):
    """tests/scripts/ddp_rank_flow.py: find_unused_parameters, a bf16 layer one rank leaves out,
    beside a second model: raw backwards (twice in a step), .grad right after, no_sync, against
    torch DDP (strategies/ddp.py, _in_order)."""
    res = launch(["--num_processes", str(n), "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "ddp_rank_flow.py")], timeout=wait_s(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert f"rank flow OK on {n} processes" in res.stdout


def test_float64_parameters_match_torch_ddp_under_join_and_reentrant_checkpointing():
    """tests/scripts/ddp_float64.py: a float64 layer (no buffer) inside join_uneven_inputs, two
    backwards per step and two joined models, bit for bit torch DDP under torch's Join
    (DDPStrategy.reduce_unbuffered after each sync backward, shadow_unbuffered per backward);
    and under reentrant checkpointing without join (reduced at the step)."""
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "ddp_float64.py")], timeout=wait_s(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "float64 OK" in res.stdout


def test_reentrant_checkpointing_where_groups_finish_in_order():
    """tests/scripts/ddp_reentrant_join.py: the output layer in a reentrant checkpoint, inside
    join_uneven_inputs and/or with find_unused_parameters, bf16 + fp32 (+ float64) layers,
    Accelerator.backward and raw backward: the nested backward's end is not taken for the
    backward's (it raised "received no gradient"); every gradient equals torch's local
    gradients summed over the ranks that had the batch / world size, in the parameter's dtype."""
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "ddp_reentrant_join.py")], timeout=wait_s(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "reentrant join OK" in res.stdout


def test_clip_of_16bit_gradients_matches_torch_ddp_bit_for_bit():
    """tests/scripts/ddp_clip16.py: bf16 and fp16 models under DDP with several buckets, clipped:
    each parameter's norm rounded to 16 bits as torch's clip_grad_norm_ takes it, from the
    buffer (first step) and from the sums measured after each bucket's all-reduce (later ones):
    norms and parameters torch DDP's bit for bit."""
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "ddp_clip16.py")], timeout=wait_s(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "clip16 OK" in res.stdout

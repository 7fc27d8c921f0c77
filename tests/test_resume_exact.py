"""Resume in the loop users write (prepare -> load_state -> skip_first_batches -> train) is
bitwise the run that was never interrupted: dropout in the model, shuffle on and off, with and
without use_seedable_sampler, saved mid-epoch, after an epoch's last batch and in a later
epoch, on 1 and 2 processes, each resume in a new process (tests/scripts/resume_exact.py).

References, computed in the same test: the uninterrupted run (the resumed runs must give its
losses and final parameters, bit for bit), accelerate 1.15 running the same loop without a
resume (ours must give its numbers), and plain torch DataLoaders for the in-process checks of
what a checkpoint records and how older checkpoints load.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_c import Accelerator
from accelerate_c.checkpointing import MARKER, CheckpointError

from helpers import fresh_state, make_dataset, reset_all_states  # noqa: F401
from shared_dirs import built_once
from test_launch import SCRIPTS, launch

SCRIPT = os.path.join(SCRIPTS, "resume_exact.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _python(impl, phase, workdir):
    res = subprocess.run([sys.executable, SCRIPT, impl, phase, str(workdir)], capture_output=True, text=True,
                         timeout=600, env=ENV)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _read(workdir, impl, phase, rank):
    with open(os.path.join(workdir, f"{impl}_{phase}_{rank}.json")) as f:
        return json.load(f)


def _assert_resumes_exact(workdir, ranks, phases):
    """Every resumed run's losses are the uninterrupted run's from the step it resumed at, and its
    final parameters are the same bytes."""
    for rank in range(ranks):
        full = _read(workdir, "accelerate_c", "full", rank)
        seen = set()
        for phase in phases:
            for name, got in _read(workdir, "accelerate_c", phase, rank).items():
                ref = full[name.split("_at")[0]]
                assert got["first"] > 0 and got["losses"], (rank, name)
                want = ref["losses"][got["first"]:]
                first_diff = next((i for i, (a, b) in enumerate(zip(got["losses"], want)) if a != b), None)
                assert got["losses"] == want, (f"rank {rank}, {name} (resumed at step {got['first']}): losses differ "
                                               f"from the uninterrupted run's from resumed step {first_diff} on")
                assert got["params"] == ref["params"], f"rank {rank}, {name}: final parameters differ"
                seen.add(name)
        # every variant was resumed: shuffle x seedable x where, pickle mode, reseeded, chains
        assert {n.split("_at")[0] for n in seen} == set(full), sorted(set(full) - seen)


def _one_process_phases(workdir):
    for phase in ("full", "resume", "resume2"):
        _python("accelerate_c", phase, workdir)


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """accelerate_c's one-process runs, once per pytest run (shared_dirs.py); accelerate's own run
    is added beside them by the test that needs it (its files are named apart)."""
    return built_once(tmp_path_factory, "resume_exact_1", _one_process_phases)


def test_resume_in_the_users_loop_is_bitwise_exact_on_one_process(one_process_runs):
    _assert_resumes_exact(one_process_runs, 1, ("resume", "resume2"))
    chains = [n for n in _read(one_process_runs, "accelerate_c", "resume2", 0)]
    assert len(chains) == 4, chains  # resumed runs resumed again: inside the skipped epoch, and after it


def test_resume_in_the_users_loop_is_bitwise_exact_on_two_processes(tmp_path):
    for phase in ("full", "resume"):
        res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0", SCRIPT, "accelerate_c", phase,
                      str(tmp_path)], env={"PYTHONPATH": ENV["PYTHONPATH"], "OMP_NUM_THREADS": "1"}, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert f"resume_exact accelerate_c {phase} OK on 2 processes" in res.stdout
    _assert_resumes_exact(tmp_path, 2, ("resume",))
    # the ranks really see different data (else one rank's check would stand for both)
    r0, r1 = (_read(tmp_path, "accelerate_c", "full", r) for r in (0, 1))
    assert r0["shuffle1_seedable0_mid0"]["losses"] != r1["shuffle1_seedable0_mid0"]["losses"]


def test_a_run_that_never_resumes_gives_accelerates_numbers(one_process_runs):
    """The uninterrupted runs (which also save checkpoints along the way) against accelerate 1.15
    running the same loop: same losses and parameters, bitwise, in every variant."""
    pytest.importorskip("accelerate")
    _python("accelerate", "full", one_process_runs)
    ours, theirs = (_read(one_process_runs, impl, "full", 0) for impl in ("accelerate_c", "accelerate"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name]["losses"] == theirs[name]["losses"], f"{name}: losses differ from accelerate's"
        assert ours[name]["params"] == theirs[name]["params"], f"{name}: parameters differ from accelerate's"


# ---- in-process: what a checkpoint records, older checkpoints, bad records -------------------------------
def _loader(generator=None):
    return DataLoader(make_dataset(24), batch_size=4, shuffle=True, generator=generator)


def _interrupted(tmp_path, generator=None, k=3, **save_kw):
    """One process: a shuffled loader, k batches of epoch 0 taken, save_state, then the rest of
    the epoch and a few draws from the global RNG (what dropout would take)."""
    torch.manual_seed(11)
    acc = Accelerator(cpu=True)
    dl = acc.prepare(_loader(generator))
    it = iter(dl)
    for _ in range(k):
        next(it)
    saved_rng = torch.get_rng_state()
    path = acc.save_state(tmp_path / "ck", **save_kw)
    rest = [b[0] for b in it]
    return path, saved_rng, rest, torch.rand(5)


def _resumed(path, k=3, generator=None):
    reset_all_states()
    torch.manual_seed(11)
    acc = Accelerator(cpu=True)
    dl = acc.prepare(_loader(generator))
    acc.load_state(path)
    return acc, dl, [b[0] for b in acc.skip_first_batches(dl, k)], torch.rand(5)


def _edit(path, name, change):
    """Rewrites a state JSON of the checkpoint with change(state) applied, recording its new size
    in the marker (a checkpoint written that way: only the content is wrong)."""
    doc = json.loads((path / name).read_text())
    change(doc["state"])
    data = json.dumps(doc).encode()
    (path / name).write_bytes(data)
    marker = json.loads((path / MARKER).read_text())
    marker["files"][name] = len(data)
    (path / MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("own_generator", [False, True])
def test_a_mid_epoch_checkpoint_replays_the_epoch_and_the_rng(tmp_path, own_generator):
    """The batches after a resume are the interrupted epoch's, and the global RNG then draws what
    the uninterrupted run drew; with the loader's own generator too (shuffle=True, generator=)."""
    gen = (lambda: torch.Generator().manual_seed(5)) if own_generator else (lambda: None)
    path, _, rest, draws = _interrupted(tmp_path, gen())
    _, _, got, got_draws = _resumed(path, generator=gen())
    assert len(got) == len(rest) == 3
    for a, b in zip(got, rest):
        assert torch.equal(a, b)
    assert torch.equal(got_draws, draws)
    st = json.loads((path / "dataloader_0.json").read_text())["state"]
    assert st["mid_epoch"] is True and st["batches_seen"] == 3 and st["iteration"] == 0, st


def test_a_save_right_after_a_load_keeps_the_mid_epoch_position(tmp_path):
    """load_state, then save_state before the resumed epoch begins (and once more after
    skip_first_batches made its loader): resuming from that copy is as exact as from the first."""
    path, _, rest, draws = _interrupted(tmp_path)
    reset_all_states()
    torch.manual_seed(11)
    acc = Accelerator(cpu=True)
    dl = acc.prepare(_loader())
    acc.load_state(path)
    copy1 = acc.save_state(tmp_path / "copy1")
    acc.skip_first_batches(dl, 3)
    copy2 = acc.save_state(tmp_path / "copy2")
    for again in (copy1, copy2):
        _, _, got, got_draws = _resumed(again)
        assert len(got) == len(rest) and all(torch.equal(a, b) for a, b in zip(got, rest)), again
        assert torch.equal(got_draws, draws), again


def _epochs_with_a_rollback(acc_cls, tmp_path, rollback_at=None, tag="ck"):
    """Two epochs of a shuffled prepared loader; at batch `rollback_at` of epoch 0, save_state,
    a detour (draws from the global RNG) and load_state inside the loop; then a second save at
    batch 4 of epoch 0. Returns the batches of both epochs and the second save's path."""
    torch.manual_seed(11)
    acc = acc_cls(cpu=True)
    dl = acc.prepare(_loader())
    epochs, second = [], None
    for epoch in range(2):
        seen = []
        for i, b in enumerate(dl):
            seen.append(b[0])
            if epoch == 0 and i == rollback_at:
                acc.save_state(str(tmp_path / tag))
                torch.rand(7)
                acc.load_state(str(tmp_path / tag))
            if epoch == 0 and i == 4:
                second = acc.save_state(str(tmp_path / (tag + "_second")))
        epochs.append(seen)
    return epochs, second


def test_load_state_inside_the_loop_leaves_the_data_order_alone(tmp_path):
    """A save and load of the same state inside the loop (a rollback after a detour) changes
    nothing in the data: the rest of the epoch and the next epoch come as in the run without it,
    and as in accelerate 1.15's run with the same rollback; a later save records the loader's
    true position. (Before, the loaded position was armed for the next epoch, which then replayed
    the first one's order, and the later save recorded the loaded batch count.)"""
    from accelerate import Accelerator as HFAccelerator

    plain, _ = _epochs_with_a_rollback(Accelerator, tmp_path, None, "plain")
    reset_all_states()
    ours, second = _epochs_with_a_rollback(Accelerator, tmp_path, 0, "ours")
    reset_all_states()
    theirs, _ = _epochs_with_a_rollback(HFAccelerator, tmp_path, 0, "theirs")
    reset_all_states()
    for ref in (plain, theirs):
        assert [len(e) for e in ours] == [len(e) for e in ref]
        assert all(torch.equal(a, b) for e, f in zip(ours, ref) for a, b in zip(e, f))
    st = json.loads((second / "dataloader_0.json").read_text())["state"]
    assert st["iteration"] == 0 and st["batches_seen"] == 5 and st["mid_epoch"] is True, st


def test_load_state_of_another_position_inside_the_loop_warns_and_goes_on(tmp_path):
    """A checkpoint of another position loaded inside the loop cannot move the iterator: a
    warning names the loader's position and the checkpoint's, and the epoch goes on as it was."""
    path, _, rest, _ = _interrupted(tmp_path, k=3)  # saved at batch 3 of epoch 0
    reset_all_states()
    torch.manual_seed(11)
    acc = Accelerator(cpu=True)
    dl = acc.prepare(_loader())
    it = iter(dl)
    first = next(it)  # batch 1 of epoch 0 handed out
    with pytest.warns(UserWarning, match=r"in epoch 0 \(batch 1 handed out\).*\(epoch 0, batch 3\)"):
        acc.load_state(path)
    got = [b[0] for b in it]
    assert len(got) == len(dl) - 1 and not torch.equal(first[0], got[0])


def test_a_checkpoint_after_the_last_batch_is_at_the_next_epoch(tmp_path):
    """Saved while the epoch's last batch is being trained on: the next epoch is where a resume
    starts (iteration 1, nothing to replay), and it draws its order from the RNG saved, as the
    uninterrupted run's next epoch does."""
    torch.manual_seed(11)
    acc = Accelerator(cpu=True)
    dl = acc.prepare(_loader())
    for i, _ in enumerate(dl):
        if i == len(dl) - 1:
            path = acc.save_state(tmp_path / "ck")
    ref = [b[0] for b in dl]  # epoch 1, uninterrupted
    _, dl2, got, _ = _resumed(path, k=0)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and len(got) == len(ref)
    assert dl2.iteration == 2  # the skipped loader's epoch counted for the prepared one
    st = json.loads((path / "dataloader_0.json").read_text())["state"]
    assert st["iteration"] == 1 and st["batches_seen"] == 0 and st["mid_epoch"] is False, st
    rs = json.loads((path / "random_states_0.json").read_text())["state"]
    assert rs["dataloader_epoch_start"] == [None]


def test_a_checkpoint_without_epoch_records_resumes_as_before(tmp_path):
    """A checkpoint of before (no mid_epoch, no dataloader_epoch_start) loads, and a skipped
    loader then creates its iterator from the RNG state loaded, as it did: the batches and draws
    of a plain DataLoader created under that state."""
    path, saved_rng, _, _ = _interrupted(tmp_path)
    _edit(path, "dataloader_0.json", lambda st: st.pop("mid_epoch", None))
    _edit(path, "random_states_0.json", lambda st: st.pop("dataloader_epoch_start", None))
    acc, dl, got, got_draws = _resumed(path)
    torch.set_rng_state(saved_rng)
    ref = [b[0] for b in _loader()][3:]
    ref_draws = torch.rand(5)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    assert torch.equal(got_draws, ref_draws)
    assert dl.iteration == 0  # unlinked, as before: the skipped loader's epoch is its own


def _bad_entry(st, **change):
    st["dataloader_epoch_start"][0].update(change)


BAD_RECORDS = {
    "not_a_list": ("random_states_0.json", lambda st: st.update(dataloader_epoch_start=5),
                   r"random_states_0\.json: dataloader_epoch_start must be a list"),
    "entry_not_an_object": ("random_states_0.json", lambda st: st.update(dataloader_epoch_start=[[1, 2]]),
                            r"random_states_0\.json: dataloader_epoch_start\[0\] must be null or an object"),
    "entry_without_rng": ("random_states_0.json", lambda st: st["dataloader_epoch_start"][0].pop("rng"),
                          r"random_states_0\.json: dataloader_epoch_start\[0\] must be null or an object"),
    "bad_rng": ("random_states_0.json",
                lambda st: st["dataloader_epoch_start"][0]["rng"].update(random_state={"__tuple__": [3, [1], None]}),
                r"random_states_0\.json: dataloader_epoch_start\[0\]\['rng'\]: invalid random states"),
    "bad_generator": ("random_states_0.json",
                      lambda st: st["dataloader_epoch_start"][0]["generators"].update(sampler=[1, 2, 3]),
                      r"random_states_0\.json: dataloader_epoch_start\[0\]\['generators'\]\['sampler'\] is not a "
                      r"generator state"),
    "mid_epoch_not_a_bool": ("dataloader_0.json", lambda st: st.update(mid_epoch=1),
                             r"dataloader_0\.json: mid_epoch must be true or false"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_bad_epoch_record_names_the_file_and_key_and_changes_nothing(tmp_path, case):
    name, change, match = BAD_RECORDS[case]
    path, _, _, _ = _interrupted(tmp_path, torch.Generator().manual_seed(5))
    _edit(path, name, change)
    reset_all_states()
    acc = Accelerator(cpu=True)
    dl = acc.prepare(_loader(torch.Generator().manual_seed(5)))
    for _ in dl:  # an epoch, so that the loader's position differs from the checkpoint's
        pass
    rng = torch.get_rng_state()
    gen = dl.generator.get_state()
    with pytest.raises(CheckpointError, match=match):
        acc.load_state(path)
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(dl.generator.get_state(), gen)
    assert dl.iteration == 1


def test_a_pickle_mode_checkpoint_with_epoch_records_loads_in_accelerate(tmp_path):
    """safe_serialization=False: random_states_0.pkl carries the epoch records too; accelerate
    1.15 (which drops a random-states file it cannot read without a word) still restores its RNG
    from it, and ours resumes from it exactly."""
    pytest.importorskip("accelerate")
    path, saved_rng, rest, draws = _interrupted(tmp_path, safe_serialization=False)
    assert (path / "random_states_0.pkl").is_file()
    _, _, got, got_draws = _resumed(path)
    assert all(torch.equal(a, b) for a, b in zip(got, rest)) and torch.equal(got_draws, draws)
    reset_all_states()
    import accelerate

    torch.manual_seed(0)
    a = accelerate.Accelerator(cpu=True)
    a.load_state(str(path))
    assert torch.equal(torch.get_rng_state(), saved_rng)

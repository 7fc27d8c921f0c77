"""DeepSpeedScaler (accelerate_c/ds_scaler.py over csrc/core/ds_scaler.c): DeepSpeed's fp16
loss-scale rule, checked update by update against a plain-Python restatement of that rule written
here (DynamicLossScaler.update_scale as DeepSpeed documents and runs it; not our code), on random
overflow sequences and settings; the state_dict round trip; the errors."""
import json
import math
import random

import pytest
import torch

import accelerate_c
from accelerate_c import _C
from accelerate_c.ds_scaler import STATE_KEYS, DeepSpeedScaler
from ds_scaler_rule import MinScaleError, ReferenceScaler


def counters(scaler):
    st = scaler.state_dict()
    return (st["cur_scale"], st["cur_iter"], st["last_overflow_iter"], st["cur_hysteresis"])


def random_config(rng):
    window = rng.randint(1, 5)
    hysteresis = rng.randint(1, 3)
    init = rng.choice([2.0 ** rng.randint(-3, 20), 3000.0, 0.1, 12345.678])
    # min_scale: often one halving sequences reach (the floor and its error), sometimes one they
    # do not hit exactly, sometimes above init_scale (accepted, as DeepSpeed accepts it)
    kind = rng.random()
    if kind < 0.5:
        min_scale = init / 2.0 ** rng.randint(0, 4)
    elif kind < 0.8:
        min_scale = init / rng.choice([3.0, 5.5, 10.0])
    elif kind < 0.9:
        min_scale = init * 2.0
    else:
        min_scale = 2.0 ** -rng.randint(0, 10)
    return dict(init_scale=init, loss_scale_window=window, hysteresis=hysteresis,
                consecutive_hysteresis=rng.random() < 0.5, min_loss_scale=min_scale,
                static=rng.random() < 0.1, raise_error_at_min_scale=rng.random() < 0.7)


def reference_of(cfg):
    return ReferenceScaler(cfg["init_scale"], cfg["loss_scale_window"], cfg["min_loss_scale"], cfg["hysteresis"],
                           cfg["consecutive_hysteresis"], dynamic=not cfg["static"],
                           raise_at_min=cfg["raise_error_at_min_scale"])


def step_both(ours, ref, overflow, where):
    try:
        ref.update(overflow)
        ref_failed = False
    except MinScaleError:
        ref_failed = True
    before = ours.state_dict()
    if ref_failed:
        with pytest.raises(accelerate_c.CoreError) as e:
            ours.update(overflow)
        assert e.value.code == "AC_ERR_STATE", where
        assert ours.state_dict() == before, where
    else:
        ours.update(overflow)
    assert counters(ours) == ref.counters(), where
    assert ours.get_scale() == ref.cur_scale, where
    return ref_failed


@pytest.mark.parametrize("seed", range(24))
def test_matches_reference_on_random_sequences(seed):
    rng = random.Random(seed)
    failures = 0
    for case in range(25):
        cfg = random_config(rng)
        ours, ref = DeepSpeedScaler(**cfg), reference_of(cfg)
        assert ours.is_dynamic() == (not cfg["static"])
        p = rng.choice([0.02, 0.1, 0.3, 0.6, 0.9])
        # bursts as well as scattered overflows, so hysteresis runs out in a row sometimes
        burst = 0
        for k in range(rng.randint(20, 160)):
            if burst == 0 and rng.random() < p / 4:
                burst = rng.randint(1, 4)
            overflow = burst > 0 or rng.random() < p
            burst = max(0, burst - 1)
            failures += step_both(ours, ref, overflow, f"seed {seed} case {case} step {k} cfg {cfg}")
        st = ours.state_dict()
        assert (st["scale_window"], st["min_scale"], st["delayed_shift"], st["consecutive_hysteresis"],
                st["dynamic"]) == (cfg["loss_scale_window"], cfg["min_loss_scale"], cfg["hysteresis"],
                                   cfg["consecutive_hysteresis"], not cfg["static"])


def test_random_settings_cover_the_rule():
    """The random cases above reach every branch: growth, absorbed overflows, lowering, the floor
    with and without the error, static scalers."""
    seen = set()
    for seed in range(24):
        rng = random.Random(seed)
        for _ in range(25):
            cfg = random_config(rng)
            ref = reference_of(cfg)
            p = rng.choice([0.02, 0.1, 0.3, 0.6, 0.9])
            burst = 0
            if cfg["static"]:
                seen.add("static")
            for _ in range(rng.randint(20, 160)):
                if burst == 0 and rng.random() < p / 4:
                    burst = rng.randint(1, 4)
                overflow = burst > 0 or rng.random() < p
                burst = max(0, burst - 1)
                scale, hyst = ref.cur_scale, ref.cur_hysteresis
                try:
                    ref.update(overflow)
                except MinScaleError:
                    seen.add("error")
                    continue
                if ref.cur_scale > scale:
                    seen.add("grow")
                elif ref.cur_scale < scale:
                    seen.add("lower")
                elif overflow and ref.cur_hysteresis < hyst:
                    seen.add("absorb")
                elif overflow and ref.dynamic and ref.cur_scale == ref.min_scale:
                    seen.add("floor")
                if overflow and ref.dynamic and ref.cur_scale == ref.min_scale and scale != ref.min_scale:
                    seen.add("clamped")
    assert seen >= {"static", "error", "grow", "lower", "absorb", "floor", "clamped"}, seen


def test_growth_timing_worked_by_hand():
    # window 3: the first growth at the 4th clean step (window + 1), the next 3 clean steps later;
    # after an overflow, again at the 4th clean step
    s = DeepSpeedScaler(init_scale=8.0, loss_scale_window=3, hysteresis=1, min_loss_scale=1.0)
    seen = []
    for overflow in [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]:
        s.update(bool(overflow))
        seen.append(s.get_scale())
    assert seen == [8, 8, 8, 16, 16, 16, 32, 16, 16, 16, 16, 32]


def test_hysteresis_absorbs_then_lowers():
    s = DeepSpeedScaler(init_scale=1024.0, loss_scale_window=100, hysteresis=2, consecutive_hysteresis=False)
    s.update(True)
    assert s.get_scale() == 1024.0 and s.state_dict()["cur_hysteresis"] == 1
    s.update(False)  # not consecutive: no refill
    s.update(True)
    assert s.get_scale() == 512.0
    c = DeepSpeedScaler(init_scale=1024.0, loss_scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    c.update(True)
    c.update(False)  # consecutive: refilled
    assert c.state_dict()["cur_hysteresis"] == 2
    c.update(True)
    assert c.get_scale() == 1024.0


def test_error_at_min_scale_names_both_values_and_changes_nothing():
    s = DeepSpeedScaler(init_scale=8.0, loss_scale_window=5, hysteresis=1, min_loss_scale=4.0)
    s.update(True)
    assert s.get_scale() == 4.0
    before = s.state_dict()
    with pytest.raises(RuntimeError, match=r"loss scale 4 already at min_loss_scale 4") as e:
        s.update(True)
    assert isinstance(e.value, accelerate_c.CoreError) and e.value.code == "AC_ERR_STATE"
    assert s.state_dict() == before
    s.update(False)  # a clean step still counts
    assert s.state_dict()["cur_iter"] == before["cur_iter"] + 1
    quiet = DeepSpeedScaler(init_scale=4.0, loss_scale_window=5, hysteresis=1, min_loss_scale=4.0,
                            raise_error_at_min_scale=False)
    quiet.update(True)
    assert quiet.get_scale() == 4.0 and quiet.state_dict()["last_overflow_iter"] == 0


def test_static_scale_never_changes():
    s = DeepSpeedScaler(init_scale=128.0, static=True)
    before = s.state_dict()
    assert before["dynamic"] is False
    for k in range(50):
        s.update(k % 3 != 0)
    assert s.get_scale() == 128.0 and s.state_dict() == before


def test_growth_reaches_inf_as_deepspeed_does():
    cfg = dict(init_scale=1.0, loss_scale_window=1, hysteresis=1, min_loss_scale=1.0)
    s, ref = DeepSpeedScaler(**cfg), ReferenceScaler(1.0, 1, 1.0, 1, False)
    for k in range(1100):
        step_both(s, ref, False, k)
    assert math.isinf(s.get_scale())
    step_both(s, ref, True, "overflow at inf")
    t = DeepSpeedScaler()
    t.load_state_dict(s.state_dict())  # what growth reached loads back
    assert t.state_dict() == s.state_dict()


@pytest.mark.parametrize("seed", range(8))
def test_state_dict_round_trip_mid_sequence(seed):
    rng = random.Random(1000 + seed)
    cfg = random_config(rng)
    cfg["raise_error_at_min_scale"] = False  # a run that can go on for the whole sequence
    a = DeepSpeedScaler(**cfg)
    flags = [rng.random() < 0.3 for _ in range(200)]
    for f in flags[:rng.randint(1, 120)]:
        a.update(f)
    saved = json.loads(json.dumps(a.state_dict()))  # checkpoints hold it as JSON
    assert set(saved) == set(STATE_KEYS)
    # a scaler built with other settings takes the saved configuration along with the counters
    b = DeepSpeedScaler(init_scale=3.0, loss_scale_window=7, hysteresis=3, consecutive_hysteresis=True,
                        min_loss_scale=0.5, static=not cfg["static"], raise_error_at_min_scale=False)
    b.load_state_dict(saved)
    assert b.state_dict() == a.state_dict()
    n = a.state_dict()["cur_iter"]
    for f in flags[n:]:
        a.update(f)
        b.update(f)
        assert b.state_dict() == a.state_dict()


def test_load_state_dict_takes_zero_dim_tensors():
    a = DeepSpeedScaler(init_scale=64.0, loss_scale_window=2)
    for f in (True, False, False, False):
        a.update(f)
    st = {k: (torch.tensor(v) if k in ("cur_scale", "cur_iter") else v) for k, v in a.state_dict().items()}
    b = DeepSpeedScaler()
    b.load_state_dict(st)
    assert b.state_dict() == a.state_dict()


def _good_state():
    s = DeepSpeedScaler(init_scale=256.0, loss_scale_window=4, hysteresis=2)
    for f in (False, True, False):
        s.update(f)
    return s.state_dict()


@pytest.mark.parametrize("key", STATE_KEYS)
def test_load_state_dict_names_a_missing_key(key):
    st = _good_state()
    del st[key]
    s = DeepSpeedScaler()
    before = s.state_dict()
    with pytest.raises(KeyError, match=key):
        s.load_state_dict(st)
    assert s.state_dict() == before


@pytest.mark.parametrize("key,value,exc,match", [
    ("cur_scale", 0.0, ValueError, r"cur_scale must be a number > 0, got 0"),
    ("cur_scale", -8.0, ValueError, r"cur_scale .* got -8"),
    ("cur_scale", float("nan"), ValueError, r"cur_scale .* got nan"),
    ("cur_scale", "8", TypeError, r"state\['cur_scale'\] must be a real number, got str"),
    ("cur_iter", -1, ValueError, r"cur_iter must be >= 0, got -1"),
    ("cur_iter", 2.0, TypeError, r"state\['cur_iter'\] must be an integer, got float"),
    ("last_overflow_iter", 3, ValueError, r"last_overflow_iter must be -1 .* cur_iter 3, got 3"),
    ("last_overflow_iter", -2, ValueError, r"last_overflow_iter .* got -2"),
    ("cur_hysteresis", 0, ValueError, r"cur_hysteresis must be in \[1, delayed_shift 2\], got 0"),
    ("cur_hysteresis", 3, ValueError, r"cur_hysteresis .* got 3"),
    ("cur_hysteresis", True, TypeError, r"state\['cur_hysteresis'\] must be an integer, got bool"),
    ("scale_window", 0, ValueError, r"scale_window \(fp16.loss_scale_window\) must be >= 1, got 0"),
    ("min_scale", 0.0, ValueError, r"min_scale \(fp16.min_loss_scale\) must be a finite number > 0, got 0"),
    ("min_scale", float("inf"), ValueError, r"min_scale .* got inf"),
    ("delayed_shift", 0, ValueError, r"delayed_shift \(fp16.hysteresis\) must be >= 1, got 0"),
    ("consecutive_hysteresis", 1, TypeError, r"state\['consecutive_hysteresis'\] must be True or False, got int"),
    ("dynamic", "yes", TypeError, r"state\['dynamic'\] must be True or False, got str"),
])
def test_load_state_dict_refuses_bad_values(key, value, exc, match):
    st = _good_state()
    assert st["cur_iter"] == 3 and st["delayed_shift"] == 2
    st[key] = value
    s = DeepSpeedScaler(init_scale=32.0)
    s.update(True)
    before = s.state_dict()
    with pytest.raises(exc, match=match):
        s.load_state_dict(st)
    assert s.state_dict() == before


def test_load_state_dict_refuses_empty_and_non_dicts():
    s = DeepSpeedScaler()
    with pytest.raises(RuntimeError, match="empty"):
        s.load_state_dict({})
    with pytest.raises(TypeError, match="must be a dict"):
        s.load_state_dict([("cur_scale", 1.0)])
    static = _good_state()
    static["dynamic"], static["cur_scale"] = False, float("inf")
    with pytest.raises(ValueError, match=r"cur_scale must be a finite number > 0, got inf"):
        s.load_state_dict(static)


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_scale_window=0), r"scale_window \(fp16.loss_scale_window\) must be >= 1, got 0"),
    (dict(loss_scale_window=-5), r"loss_scale_window.* got -5"),
    (dict(min_loss_scale=0.0), r"min_scale \(fp16.min_loss_scale\) must be a finite number > 0, got 0"),
    (dict(min_loss_scale=-1.0), r"min_loss_scale.* got -1"),
    (dict(min_loss_scale=float("inf")), r"min_loss_scale.* got inf"),
    (dict(hysteresis=0), r"delayed_shift \(fp16.hysteresis\) must be >= 1, got 0"),
    (dict(init_scale=0.0), r"init_scale must be a finite number > 0, got 0"),
    (dict(init_scale=-4.0), r"init_scale must be a finite number > 0, got -4"),
    (dict(init_scale=float("inf")), r"init_scale must be a finite number > 0, got inf"),
    (dict(init_scale=float("nan")), r"init_scale must be a finite number > 0, got nan"),
])
@pytest.mark.parametrize("static", [False, True])
def test_bad_configuration_names_the_value(kwargs, match, static):
    with pytest.raises(ValueError, match=match) as e:
        DeepSpeedScaler(static=static, **kwargs)
    assert e.value.code == "AC_ERR_INVALID_ARG"


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_scale_window=2.5), "loss_scale_window must be an integer, got float"),
    (dict(hysteresis=True), "hysteresis must be an integer, got bool"),
    (dict(init_scale="1024"), "init_scale must be a real number, got str"),
    (dict(min_loss_scale=None), "min_loss_scale must be a real number, got NoneType"),
    (dict(consecutive_hysteresis=1), "consecutive_hysteresis must be True or False, got int"),
    (dict(static="no"), "static must be True or False, got str"),
])
def test_bad_configuration_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        DeepSpeedScaler(**kwargs)


def test_defaults_are_deepspeeds_config_defaults():
    st = DeepSpeedScaler().state_dict()
    assert st == {"cur_scale": 65536.0, "cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": 2,
                  "scale_window": 1000, "min_scale": 1.0, "delayed_shift": 2, "consecutive_hysteresis": False,
                  "dynamic": True}


def test_loss_scaler_interface():
    s = DeepSpeedScaler(init_scale=4.0)
    assert s.is_enabled() and s.get_scale() == 4.0
    loss = torch.tensor(1.5)
    assert s.scale(loss).item() == 6.0
    out = s.scale((loss, [loss * 2]))
    assert isinstance(out, tuple) and out[0].item() == 6.0 and out[1][0].item() == 12.0
    with pytest.raises(TypeError, match="scale\\(\\) takes a tensor"):
        s.scale(1.5)
    s.update(torch.tensor(True))  # a found_inf tensor, as the optimizer wrapper may pass
    assert s.state_dict()["last_overflow_iter"] == 0
    off = DeepSpeedScaler(init_scale=4.0, enabled=False)
    assert not off.is_enabled() and off.get_scale() == 1.0 and off.scale(loss) is loss
    off.update(True)
    assert off.state_dict() == {}


def test_c_type_signature():
    s = _C.DeepSpeedLossScaler(16.0, 2, 1.0, 1, False, static=True, raise_at_min=False)
    assert s.scale == 16.0 and s.dynamic is False and s.raise_at_min is False
    with pytest.raises(TypeError):
        _C.DeepSpeedLossScaler(16.0, 2, 1.0, 1, False, True)  # static is keyword-only
    d = _C.DeepSpeedLossScaler(16.0, 2, 1.0, 1, False)
    assert d.dynamic is True and d.raise_at_min is True
    st = d.state()
    d.load(**st)
    assert d.state() == st


@pytest.mark.parametrize("seed", range(6))
def test_the_scale_after_a_clean_step_is_the_rules_and_changes_nothing(seed):
    """scale_after_clean_step (what DeepSpeed's engine unscales by: its step updates the scale
    first) is the reference rule's scale after a clean update, at every point of random overflow
    sequences, and leaves the scaler as it was."""
    rng = random.Random(100 + seed)
    cfg = random_config(rng)
    cfg["raise_error_at_min_scale"] = False
    ours = DeepSpeedScaler(**cfg)
    for k in range(80):
        before = ours.state_dict()
        probe = reference_of(cfg)
        probe.cur_scale, probe.cur_iter, probe.last_overflow_iter, probe.cur_hysteresis = counters(ours)
        probe.update(False)
        assert ours.scale_after_clean_step() == probe.cur_scale, (k, cfg)
        assert ours.state_dict() == before
        ours.update(rng.random() < 0.3)

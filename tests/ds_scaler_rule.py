"""DeepSpeed's fp16 loss-scale rule (DynamicLossScaler.update_scale, as DeepSpeed documents and
runs it) restated in plain Python, for the tests: tests/test_ds_scaler.py holds accelerate_c's
DeepSpeedScaler to it, and the differential harness's DeepSpeed reference scales its loss by it.
Not accelerate_c's code."""


class MinScaleError(Exception):
    pass


class ReferenceScaler:
    """DeepSpeed's rule restated: scale_factor 2; on an overflow with no hysteresis left the scale
    halves, floored at min_scale (an error if it is already there and raise_at_min), otherwise one
    unit of hysteresis is used; every overflow records cur_iter. On a clean step, consecutive
    hysteresis refills first; then (cur_iter - last_overflow_iter - 1) > 0 and a multiple of the
    window doubles the scale (refilling hysteresis when not consecutive). cur_iter counts every
    update that did not fail. A static scaler changes nothing."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive, dynamic=True,
                 raise_at_min=True):
        self.cur_scale = float(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive
        self.raise_at_min = raise_at_min
        self.dynamic = dynamic

    def update(self, overflow):
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_at_min:
                    raise MinScaleError()
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = (self.cur_iter - self.last_overflow_iter) - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def counters(self):
        return (self.cur_scale, self.cur_iter, self.last_overflow_iter, self.cur_hysteresis)

/* ds_scaler.c — DeepSpeed's fp16 loss-scale rule (the rule and its consequences: ds_scaler.h). */
#include "ac/ds_scaler.h"

#include <math.h>

/* The configuration checks init and load share. Messages give DeepSpeed's attribute name and
 * the config key a user wrote, since either may be what they recognise. `scale_name` is
 * "init_scale" or "cur_scale"; `inf_ok` lets a loaded dynamic scale be the +inf growth reaches. */
static ac_result_t check_config(const char *scale_name, double scale, int inf_ok, int64_t window, double min_scale,
                                int64_t delayed_shift) {
  if (!(scale > 0.0) || (!inf_ok && !isfinite(scale)))
    return AC_FAIL(AC_ERR_INVALID_ARG, "%s must be a %snumber > 0, got %g", scale_name, inf_ok ? "" : "finite ",
                   scale);
  if (window < 1)
    return AC_FAIL(AC_ERR_INVALID_ARG, "scale_window (fp16.loss_scale_window) must be >= 1, got %lld",
                   (long long)window);
  if (!(min_scale > 0.0) || !isfinite(min_scale))
    return AC_FAIL(AC_ERR_INVALID_ARG, "min_scale (fp16.min_loss_scale) must be a finite number > 0, got %g",
                   min_scale);
  if (delayed_shift < 1)
    return AC_FAIL(AC_ERR_INVALID_ARG, "delayed_shift (fp16.hysteresis) must be >= 1, got %lld",
                   (long long)delayed_shift);
  return AC_OK;
}

ac_result_t ac_ds_scaler_init(ac_ds_scaler_t *s, double init_scale, int64_t scale_window, double min_scale,
                              int64_t delayed_shift, int consecutive_hysteresis, int dynamic, int raise_at_min) {
  if (!s) return AC_FAIL(AC_ERR_INVALID_ARG, "scaler is NULL");
  AC_CHECK(check_config("init_scale", init_scale, 0, scale_window, min_scale, delayed_shift));
  s->cur_scale = init_scale;
  s->scale_factor = AC_DS_SCALE_FACTOR;
  s->min_scale = min_scale;
  s->scale_window = scale_window;
  s->delayed_shift = delayed_shift;
  s->cur_hysteresis = delayed_shift;
  s->cur_iter = 0;
  s->last_overflow_iter = -1;
  s->consecutive_hysteresis = consecutive_hysteresis != 0;
  s->raise_at_min = raise_at_min != 0;
  s->dynamic = dynamic != 0;
  return AC_OK;
}

ac_result_t ac_ds_scaler_load(ac_ds_scaler_t *s, const ac_ds_scaler_t *from) {
  if (!s || !from) return AC_FAIL(AC_ERR_INVALID_ARG, "scaler or saved state is NULL");
  AC_CHECK(check_config("cur_scale", from->cur_scale, from->dynamic != 0, from->scale_window, from->min_scale,
                        from->delayed_shift));
  if (from->scale_factor != AC_DS_SCALE_FACTOR)
    return AC_FAIL(AC_ERR_INVALID_ARG, "scale_factor must be %g (DeepSpeed's fixed factor), got %g",
                   AC_DS_SCALE_FACTOR, from->scale_factor);
  if (from->cur_iter < 0)
    return AC_FAIL(AC_ERR_INVALID_ARG, "cur_iter must be >= 0, got %lld", (long long)from->cur_iter);
  if (from->last_overflow_iter < -1 || from->last_overflow_iter >= from->cur_iter)
    return AC_FAIL(AC_ERR_INVALID_ARG,
                   "last_overflow_iter must be -1 (no overflow yet) or an earlier step than cur_iter %lld, got %lld",
                   (long long)from->cur_iter, (long long)from->last_overflow_iter);
  if (from->cur_hysteresis < 1 || from->cur_hysteresis > from->delayed_shift)
    return AC_FAIL(AC_ERR_INVALID_ARG, "cur_hysteresis must be in [1, delayed_shift %lld], got %lld",
                   (long long)from->delayed_shift, (long long)from->cur_hysteresis);
  *s = *from;
  s->consecutive_hysteresis = from->consecutive_hysteresis != 0;
  s->raise_at_min = from->raise_at_min != 0;
  s->dynamic = from->dynamic != 0;
  return AC_OK;
}

ac_result_t ac_ds_scaler_update(ac_ds_scaler_t *s, int overflow) {
  if (!s) return AC_FAIL(AC_ERR_INVALID_ARG, "scaler is NULL");
  if (!s->dynamic) return AC_OK; /* a static scale: DeepSpeed's static scaler updates nothing */
  /* checked first so that the error leaves everything as it was; it also keeps
   * cur_iter - last_overflow_iter (last >= -1) inside int64_t below */
  if (s->cur_iter == INT64_MAX)
    return AC_FAIL(AC_ERR_STATE, "loss scaler step counter cur_iter is at its maximum %lld", (long long)s->cur_iter);
  if (overflow) {
    if (s->delayed_shift == 1 || s->cur_hysteresis == 1) {
      /* exact comparison, as DeepSpeed's: the max() below stores min_scale itself once the
       * scale reaches it, so equality is what "already at the floor" means */
      if (s->cur_scale == s->min_scale && s->raise_at_min)
        return AC_FAIL_HINT(AC_ERR_STATE,
                            "look for the cause of the inf/NaN gradients, or lower fp16.min_loss_scale",
                            "fp16 gradients overflowed with the loss scale %g already at min_loss_scale %g: "
                            "the scale cannot be lowered further, so this run cannot go on",
                            s->cur_scale, s->min_scale);
      double lowered = s->cur_scale / s->scale_factor;
      s->cur_scale = lowered > s->min_scale ? lowered : s->min_scale;
    } else {
      s->cur_hysteresis -= 1;
    }
    s->last_overflow_iter = s->cur_iter;
  } else {
    if (s->consecutive_hysteresis) s->cur_hysteresis = s->delayed_shift;
    int64_t stable = s->cur_iter - s->last_overflow_iter - 1;
    if (stable > 0 && stable % s->scale_window == 0) {
      if (!s->consecutive_hysteresis) s->cur_hysteresis = s->delayed_shift;
      s->cur_scale *= s->scale_factor;
    }
  }
  s->cur_iter += 1;
  return AC_OK;
}

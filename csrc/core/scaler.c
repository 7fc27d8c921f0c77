/* scaler.c — dynamic loss scaling (GradScaler's update rule). */
#include "ac/scaler.h"

#include <math.h>

static ac_result_t check(float scale, float growth, float backoff, int64_t interval) {
  if (!(scale > 0.0f) || !isfinite(scale))
    return AC_FAIL(AC_ERR_INVALID_ARG, "init_scale must be a finite number > 0, got %g", (double)scale);
  if (!(growth > 1.0f) || !isfinite(growth))
    return AC_FAIL(AC_ERR_INVALID_ARG, "growth_factor must be > 1, got %g", (double)growth);
  if (!(backoff > 0.0f && backoff < 1.0f))
    return AC_FAIL(AC_ERR_INVALID_ARG, "backoff_factor must be in (0, 1), got %g", (double)backoff);
  if (interval < 1)
    return AC_FAIL(AC_ERR_INVALID_ARG, "growth_interval must be >= 1, got %lld", (long long)interval);
  return AC_OK;
}

ac_result_t ac_scaler_init(ac_scaler_t *s, float init_scale, float growth_factor, float backoff_factor,
                           int64_t growth_interval) {
  return ac_scaler_load(s, init_scale, growth_factor, backoff_factor, growth_interval, 0);
}

ac_result_t ac_scaler_load(ac_scaler_t *s, float scale, float growth_factor, float backoff_factor,
                           int64_t growth_interval, int64_t growth_tracker) {
  if (!s) return AC_FAIL(AC_ERR_INVALID_ARG, "scaler is NULL");
  AC_CHECK(check(scale, growth_factor, backoff_factor, growth_interval));
  if (growth_tracker < 0)
    return AC_FAIL(AC_ERR_INVALID_ARG, "growth_tracker must be >= 0, got %lld", (long long)growth_tracker);
  s->scale = scale;
  s->growth_factor = growth_factor;
  s->backoff_factor = backoff_factor;
  s->growth_interval = growth_interval;
  s->growth_tracker = growth_tracker;
  return AC_OK;
}

ac_result_t ac_scaler_update(ac_scaler_t *s, int found_inf) {
  if (!s) return AC_FAIL(AC_ERR_INVALID_ARG, "scaler is NULL");
  if (found_inf) {
    /* fp32 product, as torch's _amp_update_scale_ computes it on a float tensor */
    s->scale = s->scale * s->backoff_factor;
    s->growth_tracker = 0;
    return AC_OK;
  }
  s->growth_tracker += 1;
  if (s->growth_tracker == s->growth_interval) {
    float grown = s->scale * s->growth_factor;
    if (isfinite(grown)) s->scale = grown;
    s->growth_tracker = 0;
  }
  return AC_OK;
}

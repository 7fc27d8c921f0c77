/* scaler.h — the dynamic loss-scale state machine, with torch.amp.GradScaler's semantics:
 * on a step with a non-finite gradient the scale is multiplied by backoff_factor and the
 * growth tracker resets; after growth_interval clean steps in a row the scale is multiplied by
 * growth_factor (only if the result is finite). Plain data, no allocation: embed it anywhere.
 * Not thread-safe; not collective (ranks agree on found_inf before calling update). */
#ifndef AC_SCALER_H
#define AC_SCALER_H

#include "ac/ac.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  float scale;
  float growth_factor;
  float backoff_factor;
  int64_t growth_interval;
  int64_t growth_tracker; /* clean steps since the last change */
} ac_scaler_t;

/* Validates and sets the fields; growth_tracker = 0. Errors name the bad value:
 * scale must be finite and > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1. */
ac_result_t ac_scaler_init(ac_scaler_t *s, float init_scale, float growth_factor, float backoff_factor,
                           int64_t growth_interval);

/* One optimizer step's outcome: found_inf != 0 means the step was skipped. */
ac_result_t ac_scaler_update(ac_scaler_t *s, int found_inf);

/* Restores a saved state after checking it as ac_scaler_init does (tracker must be >= 0). */
ac_result_t ac_scaler_load(ac_scaler_t *s, float scale, float growth_factor, float backoff_factor,
                           int64_t growth_interval, int64_t growth_tracker);

#ifdef __cplusplus
}
#endif
#endif

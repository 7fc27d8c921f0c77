/* ds_scaler.h — DeepSpeed's fp16 loss-scale state machine (DynamicLossScaler.update_scale in
 * deepspeed/runtime/fp16/loss_scaler.py), beside GradScaler's rule in scaler.h. The two rules
 * differ in when the scale moves, so a DeepSpeed fp16 config needs this one to give DeepSpeed's
 * numbers. Plain data, no allocation: embed it anywhere. Not thread-safe; not collective (ranks
 * agree on the overflow flag before calling update).
 *
 * The rule, one call per optimizer step (skipped or not):
 *   overflow, no hysteresis left (delayed_shift == 1 or cur_hysteresis == 1):
 *       at cur_scale == min_scale with raise_at_min: an AC_ERR_STATE error, nothing changes;
 *       else cur_scale = max(cur_scale / 2, min_scale);
 *   overflow, hysteresis left: cur_hysteresis -= 1, the scale stays;
 *   either overflow: last_overflow_iter = cur_iter;
 *   clean step: with consecutive_hysteresis, cur_hysteresis = delayed_shift; then with
 *       stable = cur_iter - last_overflow_iter - 1, if stable > 0 and stable % scale_window == 0:
 *       cur_scale *= 2 (and, without consecutive_hysteresis, cur_hysteresis = delayed_shift);
 *   every step that did not fail: cur_iter += 1.
 *
 * Consequences worth knowing (each is checked by a hand-worked case in tests/c/test_ds_scaler.c):
 * - Growth timing: the clean step that follows an overflow (or the very first step) has
 *   stable == 0, so the first growth comes at the (scale_window + 1)-th clean step in a row and
 *   later ones every scale_window clean steps. GradScaler grows after exactly growth_interval.
 * - An overflow absorbed by hysteresis still sets last_overflow_iter: the scale does not move,
 *   but the growth count starts over.
 * - Without consecutive_hysteresis, hysteresis is refilled only when the scale grows: once it is
 *   used up, every further overflow lowers the scale until the next growth. With it, any clean
 *   step refills it, so only delayed_shift overflows in a row lower the scale (and each further
 *   one in the same row lowers it again).
 * - Growth is unbounded, as in DeepSpeed: after ~1000 doublings cur_scale becomes +inf and stays
 *   there. No real run gets there (fp16 gradients overflow long before); it is kept so that the
 *   numbers stay DeepSpeed's for every sequence.
 * - An init_scale below min_scale is accepted (DeepSpeed accepts it): the first lowering then
 *   raises the scale to min_scale, because of the max().
 *
 * Static mode (DeepSpeed's fp16.loss_scale > 0, its plain LossScaler): dynamic == 0, update does
 * nothing at all, counters included (DeepSpeed's static scaler has no counters); the caller still
 * skips overflowed steps.
 *
 * Arithmetic is double, as DeepSpeed's cur_scale is a Python float (IEEE double): halving,
 * doubling and max() are the same IEEE operations in both, so every value is DeepSpeed's bit for
 * bit for any init_scale and min_scale, not only powers of two (a float would round an init_scale
 * such as 0.1, and reach +inf at 2**128 where DeepSpeed's scale goes on to 2**1023). */
#ifndef AC_DS_SCALER_H
#define AC_DS_SCALER_H

#include "ac/ac.h"

#ifdef __cplusplus
extern "C" {
#endif

/* DeepSpeed hard-codes the factor (no config key sets it); it is kept in the state so that the
 * arithmetic reads as the rule does. */
#define AC_DS_SCALE_FACTOR 2.0

typedef struct {
  double cur_scale;
  double scale_factor;        /* always AC_DS_SCALE_FACTOR */
  double min_scale;           /* fp16.min_loss_scale */
  int64_t scale_window;       /* fp16.loss_scale_window, >= 1 */
  int64_t delayed_shift;      /* fp16.hysteresis, >= 1 */
  int64_t cur_hysteresis;     /* overflows still absorbed, in [1, delayed_shift] */
  int64_t cur_iter;           /* updates made so far */
  int64_t last_overflow_iter; /* cur_iter of the last overflow; -1 before any */
  int consecutive_hysteresis; /* fp16.consecutive_hysteresis: refill on every clean step */
  int raise_at_min;           /* an overflow at min_scale is an error (DeepSpeed's ZeRO optimizers) */
  int dynamic;                /* 0: static scale, update changes nothing */
} ac_ds_scaler_t;

/* Validates and sets the fields; cur_iter = 0, last_overflow_iter = -1, cur_hysteresis =
 * delayed_shift. Errors (AC_ERR_INVALID_ARG) name the bad value: init_scale and min_scale must be
 * finite and > 0, scale_window >= 1, delayed_shift >= 1. They are checked in static mode too, so a
 * configuration is valid or not whatever the mode. *s is untouched on error. */
ac_result_t ac_ds_scaler_init(ac_ds_scaler_t *s, double init_scale, int64_t scale_window, double min_scale,
                              int64_t delayed_shift, int consecutive_hysteresis, int dynamic, int raise_at_min);

/* One optimizer step's outcome: overflow != 0 means the step was skipped. On error *s is
 * unchanged: AC_ERR_STATE for an overflow at min_scale with raise_at_min (the message names both
 * values), or when cur_iter cannot be counted further (INT64_MAX, reachable only by load). */
ac_result_t ac_ds_scaler_update(ac_ds_scaler_t *s, int overflow);

/* Restores a saved state: checks *from as init does (cur_scale may also be +inf when dynamic,
 * since growth can reach it), plus scale_factor == AC_DS_SCALE_FACTOR, cur_iter >= 0,
 * -1 <= last_overflow_iter < cur_iter (an overflow is recorded before cur_iter advances), and
 * 1 <= cur_hysteresis <= delayed_shift; then copies it. *s is untouched on error. */
ac_result_t ac_ds_scaler_load(ac_ds_scaler_t *s, const ac_ds_scaler_t *from);

#ifdef __cplusplus
}
#endif
#endif

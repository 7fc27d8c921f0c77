/* test_ds_scaler.c — csrc/include/ac/ds_scaler.h: DeepSpeed's fp16 loss-scale rule, worked by
 * hand on short sequences (growth timing, hysteresis, refill, the min_scale floor and its error,
 * static mode, unbounded growth), the argument and load checks, and random sequences checked
 * against what every single update must do. */
#include <math.h>
#include <string.h>

#include "ac/ds_scaler.h"
#include "test_util.h"

enum { C = 0, O = 1 }; /* a clean step, an overflow */

static int same_state(const ac_ds_scaler_t *a, const ac_ds_scaler_t *b) { return memcmp(a, b, sizeof *a) == 0; }

/* Runs `n` steps and checks the scale, cur_hysteresis and last_overflow_iter after each one. */
static void run_expect(ac_ds_scaler_t *s, int n, const int *steps, const double *scale, const int64_t *hyst,
                       const int64_t *last) {
  for (int i = 0; i < n; i++) {
    int64_t it = s->cur_iter;
    if (!CHECK_OK(ac_ds_scaler_update(s, steps[i]))) return;
    CHECK_MSG(s->cur_scale == scale[i], "step %d (%s): scale %g, want %g", i, steps[i] ? "overflow" : "clean",
              s->cur_scale, scale[i]);
    CHECK_MSG(s->cur_hysteresis == hyst[i], "step %d: cur_hysteresis %lld, want %lld", i, (long long)s->cur_hysteresis,
              (long long)hyst[i]);
    CHECK_MSG(s->last_overflow_iter == last[i], "step %d: last_overflow_iter %lld, want %lld", i,
              (long long)s->last_overflow_iter, (long long)last[i]);
    CHECK_EQ_INT(s->cur_iter, it + 1);
  }
}

TEST(init_sets_deepspeeds_start) {
  ac_ds_scaler_t s;
  CHECK_OK(ac_ds_scaler_init(&s, 65536.0, 1000, 1.0, 2, 0, 1, 1));
  CHECK(s.cur_scale == 65536.0);
  CHECK(s.scale_factor == 2.0);
  CHECK(s.min_scale == 1.0);
  CHECK_EQ_INT(s.scale_window, 1000);
  CHECK_EQ_INT(s.delayed_shift, 2);
  CHECK_EQ_INT(s.cur_hysteresis, 2);
  CHECK_EQ_INT(s.cur_iter, 0);
  CHECK_EQ_INT(s.last_overflow_iter, -1);
  CHECK_EQ_INT(s.consecutive_hysteresis, 0);
  CHECK_EQ_INT(s.dynamic, 1);
  CHECK_EQ_INT(s.raise_at_min, 1);
  /* flags are normalised to 0/1 */
  CHECK_OK(ac_ds_scaler_init(&s, 8.0, 3, 1.0, 1, 7, 5, 9));
  CHECK(s.consecutive_hysteresis == 1 && s.dynamic == 1 && s.raise_at_min == 1);
}

/* Window 3, no hysteresis. From the start: stable = cur_iter - (-1) - 1 = cur_iter, so the
 * updates at cur_iter 3 and 6 grow (the 4th and 7th clean steps). An overflow at cur_iter 7
 * halves; then stable = cur_iter - 7 - 1 reaches 3 at cur_iter 11: the 4th clean step after the
 * overflow grows again, then every 3rd (cur_iter 14). */
TEST(growth_timing_window_3) {
  ac_ds_scaler_t s;
  CHECK_OK(ac_ds_scaler_init(&s, 8.0, 3, 1.0, 1, 0, 1, 1));
  static const int steps[] = {C, C, C, C, C, C, C, O, C, C, C, C, C, C, C};
  static const double scale[] = {8, 8, 8, 16, 16, 16, 32, 16, 16, 16, 16, 32, 32, 32, 64};
  static const int64_t hyst[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  static const int64_t last[] = {-1, -1, -1, -1, -1, -1, -1, 7, 7, 7, 7, 7, 7, 7, 7};
  run_expect(&s, 15, steps, scale, hyst, last);
  CHECK_EQ_INT(s.cur_iter, 15);
}

/* Hysteresis 2, not consecutive. The overflow at cur_iter 0 is absorbed (hysteresis 2 -> 1, the
 * scale stays) but still restarts the growth count: the growth comes at cur_iter 4 (stable 3),
 * and refills the hysteresis to 2. */
TEST(hysteresis_2_absorbs_one_overflow) {
  ac_ds_scaler_t s;
  CHECK_OK(ac_ds_scaler_init(&s, 1024.0, 3, 1.0, 2, 0, 1, 1));
  static const int steps[] = {O, C, C, C, C, O, O};
  static const double scale[] = {1024, 1024, 1024, 1024, 2048, 2048, 1024};
  static const int64_t hyst[] = {1, 1, 1, 1, 2, 1, 1};
  static const int64_t last[] = {0, 0, 0, 0, 0, 5, 6};
  run_expect(&s, 7, steps, scale, hyst, last);
}

/* The same steps O C O under both settings. Not consecutive: the clean step does not refill
 * (only growth does), so the second overflow halves, and so does every later one until a growth.
 * Consecutive: the clean step refills, so the second overflow is absorbed too. */
TEST(consecutive_vs_not_refill) {
  ac_ds_scaler_t s;
  static const int steps[] = {O, C, O, O, C, C, C, C};
  CHECK_OK(ac_ds_scaler_init(&s, 1024.0, 3, 1.0, 2, 0, 1, 1));
  {
    /* growth at cur_iter 7: stable = 7 - 3 - 1 = 3, refilling the hysteresis */
    static const double scale[] = {1024, 1024, 512, 256, 256, 256, 256, 512};
    static const int64_t hyst[] = {1, 1, 1, 1, 1, 1, 1, 2};
    static const int64_t last[] = {0, 0, 2, 3, 3, 3, 3, 3};
    run_expect(&s, 8, steps, scale, hyst, last);
  }
  CHECK_OK(ac_ds_scaler_init(&s, 1024.0, 3, 1.0, 2, 1, 1, 1));
  {
    /* O (2 -> 1), C (refill 2), O (2 -> 1), O (at 1: halve), C (refill) ... growth at 7 */
    static const double scale[] = {1024, 1024, 1024, 512, 512, 512, 512, 1024};
    static const int64_t hyst[] = {1, 2, 1, 1, 2, 2, 2, 2};
    static const int64_t last[] = {0, 0, 2, 3, 3, 3, 3, 3};
    run_expect(&s, 8, steps, scale, hyst, last);
  }
  /* consecutive, hysteresis 3: three overflows in a row lower once, a fourth lowers again */
  CHECK_OK(ac_ds_scaler_init(&s, 64.0, 5, 1.0, 3, 1, 1, 1));
  {
    static const int st[] = {O, O, O, O, C};
    static const double scale[] = {64, 64, 32, 16, 16};
    static const int64_t hyst[] = {2, 1, 1, 1, 3};
    static const int64_t last[] = {0, 1, 2, 3, 3};
    run_expect(&s, 5, st, scale, hyst, last);
  }
}

/* min_scale 4 from 6: the first lowering is clamped (max(3, 4)); at the floor, without
 * raise_at_min, an overflow keeps the scale and still counts as an overflow. */
TEST(min_scale_clamp) {
  ac_ds_scaler_t s;
  CHECK_OK(ac_ds_scaler_init(&s, 6.0, 2, 4.0, 1, 0, 1, 0));
  static const int steps[] = {O, O, C, C, C, O};
  static const double scale[] = {4, 4, 4, 4, 8, 4};
  static const int64_t hyst[] = {1, 1, 1, 1, 1, 1};
  static const int64_t last[] = {0, 1, 1, 1, 1, 5};
  run_expect(&s, 6, steps, scale, hyst, last);
  /* an init_scale below min_scale (DeepSpeed accepts it): the first lowering raises it */
  CHECK_OK(ac_ds_scaler_init(&s, 1.0, 2, 4.0, 1, 0, 1, 1));
  CHECK_OK(ac_ds_scaler_update(&s, O));
  CHECK(s.cur_scale == 4.0);
  /* a min_scale that halving does not hit exactly: 8 -> 4 -> max(2, 3) = 3, then stays */
  CHECK_OK(ac_ds_scaler_init(&s, 8.0, 100, 3.0, 1, 0, 1, 0));
  CHECK_OK(ac_ds_scaler_update(&s, O));
  CHECK(s.cur_scale == 4.0);
  CHECK_OK(ac_ds_scaler_update(&s, O));
  CHECK(s.cur_scale == 3.0);
  CHECK_OK(ac_ds_scaler_update(&s, O));
  CHECK(s.cur_scale == 3.0);
}

TEST(error_at_min_scale_leaves_state_unchanged) {
  ac_ds_scaler_t s;
  CHECK_OK(ac_ds_scaler_init(&s, 8.0, 2, 4.0, 1, 0, 1, 1));
  CHECK_OK(ac_ds_scaler_update(&s, O)); /* 8 -> 4 */
  CHECK_OK(ac_ds_scaler_update(&s, C));
  CHECK(s.cur_scale == 4.0);
  ac_ds_scaler_t before = s;
  ac_clear_error();
  CHECK_RC(ac_ds_scaler_update(&s, O), AC_ERR_STATE);
  CHECK_CONTAINS(ac_last_error(), "loss scale 4");
  CHECK_CONTAINS(ac_last_error(), "min_loss_scale 4");
  CHECK(same_state(&s, &before));
  /* still refused, still unchanged; a clean step goes on normally */
  CHECK_RC(ac_ds_scaler_update(&s, O), AC_ERR_STATE);
  CHECK(same_state(&s, &before));
  CHECK_OK(ac_ds_scaler_update(&s, C));
  CHECK_EQ_INT(s.cur_iter, before.cur_iter + 1);

  /* at the floor with hysteresis left the overflow is absorbed, no error; the next one fails */
  CHECK_OK(ac_ds_scaler_init(&s, 4.0, 2, 4.0, 2, 0, 1, 1));
  CHECK_OK(ac_ds_scaler_update(&s, O));
  CHECK_EQ_INT(s.cur_hysteresis, 1);
  before = s;
  CHECK_RC(ac_ds_scaler_update(&s, O), AC_ERR_STATE);
  CHECK(same_state(&s, &before));
}

TEST(static_mode_changes_nothing) {
  ac_ds_scaler_t s;
  CHECK_OK(ac_ds_scaler_init(&s, 128.0, 1, 128.0, 1, 0, 0, 1));
  CHECK_EQ_INT(s.dynamic, 0);
  ac_ds_scaler_t before = s;
  tu_rng_t rng = {0x5eed5ca1eULL};
  for (int i = 0; i < 500; i++) {
    /* overflows at "min_scale" included: a static scale has no floor to hit */
    if (!CHECK_OK(ac_ds_scaler_update(&s, (int)tu_randn(&rng, 2)))) break;
    if (!CHECK(same_state(&s, &before))) break;
  }
}

/* DeepSpeed does not bound growth; a Python float doubles to inf after 2**1023, and so does ours:
 * from 1 with window 1 the first growth is at cur_iter 1, then one per step: 2**k after update
 * k (k >= 1)... until 2**1024 overflows. An overflow at inf keeps inf (inf / 2). */
TEST(growth_unbounded_like_deepspeed) {
  ac_ds_scaler_t s;
  CHECK_OK(ac_ds_scaler_init(&s, 1.0, 1, 1.0, 1, 0, 1, 1));
  CHECK_OK(ac_ds_scaler_update(&s, C));
  CHECK(s.cur_scale == 1.0);
  for (int k = 1; k <= 1023; k++) CHECK_OK(ac_ds_scaler_update(&s, C));
  CHECK(s.cur_scale == ldexp(1.0, 1023));
  CHECK_OK(ac_ds_scaler_update(&s, C));
  CHECK(isinf(s.cur_scale) && s.cur_scale > 0);
  CHECK_OK(ac_ds_scaler_update(&s, O));
  CHECK(isinf(s.cur_scale));
  /* the state growth reached loads back */
  ac_ds_scaler_t t;
  CHECK_OK(ac_ds_scaler_init(&t, 1.0, 1, 1.0, 1, 0, 1, 1));
  CHECK_OK(ac_ds_scaler_load(&t, &s));
  CHECK(same_state(&t, &s));
}

TEST(bad_arguments_name_the_value) {
  ac_ds_scaler_t s, sentinel;
  memset(&sentinel, 0xA5, sizeof sentinel);
  struct {
    double init, min;
    int64_t window, shift;
    const char *needle;
  } bad[] = {
      {0.0, 1.0, 10, 1, "init_scale must be a finite number > 0, got 0"},
      {-2.0, 1.0, 10, 1, "init_scale must be a finite number > 0, got -2"},
      {INFINITY, 1.0, 10, 1, "init_scale must be a finite number > 0, got inf"},
      {NAN, 1.0, 10, 1, "init_scale"},
      {8.0, 1.0, 0, 1, "scale_window (fp16.loss_scale_window) must be >= 1, got 0"},
      {8.0, 1.0, -3, 1, "got -3"},
      {8.0, 0.0, 10, 1, "min_scale (fp16.min_loss_scale) must be a finite number > 0, got 0"},
      {8.0, -1.0, 10, 1, "got -1"},
      {8.0, INFINITY, 10, 1, "min_scale (fp16.min_loss_scale) must be a finite number > 0, got inf"},
      {8.0, NAN, 10, 1, "min_scale"},
      {8.0, 1.0, 10, 0, "delayed_shift (fp16.hysteresis) must be >= 1, got 0"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    for (int dynamic = 0; dynamic <= 1; dynamic++) {
      s = sentinel;
      ac_clear_error();
      CHECK_RC(ac_ds_scaler_init(&s, bad[i].init, bad[i].window, bad[i].min, bad[i].shift, 0, dynamic, 1),
               AC_ERR_INVALID_ARG);
      CHECK_CONTAINS(ac_last_error(), bad[i].needle);
      CHECK_MSG(same_state(&s, &sentinel), "case %zu: state written on error", i);
    }
  }
  CHECK_RC(ac_ds_scaler_init(NULL, 8.0, 1, 1.0, 1, 0, 1, 1), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_ds_scaler_update(NULL, 1), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_ds_scaler_load(NULL, &s), AC_ERR_INVALID_ARG);
  CHECK_RC(ac_ds_scaler_load(&s, NULL), AC_ERR_INVALID_ARG);
}

TEST(load_round_trip_and_checks) {
  ac_ds_scaler_t a, b;
  CHECK_OK(ac_ds_scaler_init(&a, 256.0, 2, 1.0, 2, 0, 1, 1));
  static const int head[] = {C, O, C, C, O, C};
  for (size_t i = 0; i < sizeof head / sizeof head[0]; i++) CHECK_OK(ac_ds_scaler_update(&a, head[i]));
  CHECK_OK(ac_ds_scaler_init(&b, 8.0, 7, 2.0, 3, 1, 0, 1));
  CHECK_OK(ac_ds_scaler_load(&b, &a));
  CHECK(same_state(&a, &b));
  tu_rng_t rng = {42};
  for (int i = 0; i < 200; i++) {
    int f = tu_randn(&rng, 3) == 0;
    ac_result_t ra = ac_ds_scaler_update(&a, f), rb = ac_ds_scaler_update(&b, f);
    CHECK(ra == rb);
    if (!CHECK(same_state(&a, &b))) break;
  }

  ac_ds_scaler_t good;
  CHECK_OK(ac_ds_scaler_init(&good, 256.0, 2, 1.0, 2, 0, 1, 1));
  good.cur_iter = 10;
  good.last_overflow_iter = 9;
  good.cur_hysteresis = 1;
  CHECK_OK(ac_ds_scaler_load(&b, &good));
  struct {
    int field;
    double d;
    int64_t v;
    const char *needle;
  } bad[] = {
      {0, 0.0, 0, "cur_scale must be a number > 0, got 0"},
      {0, NAN, 0, "cur_scale must be a number > 0, got nan"},
      {1, 3.0, 0, "scale_factor must be 2"},
      {2, 0, -1, "cur_iter must be >= 0, got -1"},
      {3, 0, 10, "earlier step than cur_iter 10, got 10"},
      {3, 0, -2, "got -2"},
      {4, 0, 0, "cur_hysteresis must be in [1, delayed_shift 2], got 0"},
      {4, 0, 3, "got 3"},
      {5, 0, 0, "scale_window"},
      {6, 0, 0, "delayed_shift"},
      {7, 0.0, 0, "min_scale"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ac_ds_scaler_t from = good, before = b;
    switch (bad[i].field) {
      case 0: from.cur_scale = bad[i].d; break;
      case 1: from.scale_factor = bad[i].d; break;
      case 2: from.cur_iter = bad[i].v; break;
      case 3: from.last_overflow_iter = bad[i].v; break;
      case 4: from.cur_hysteresis = bad[i].v; break;
      case 5: from.scale_window = bad[i].v; break;
      case 6: from.delayed_shift = bad[i].v; break;
      default: from.min_scale = bad[i].d; break;
    }
    ac_clear_error();
    CHECK_RC(ac_ds_scaler_load(&b, &from), AC_ERR_INVALID_ARG);
    CHECK_CONTAINS(ac_last_error(), bad[i].needle);
    CHECK_MSG(same_state(&b, &before), "case %zu: state changed on a refused load", i);
  }
  /* +inf is a scale growth can reach (dynamic), never a static one */
  ac_ds_scaler_t from = good;
  from.cur_scale = INFINITY;
  CHECK_OK(ac_ds_scaler_load(&b, &from));
  from.dynamic = 0;
  CHECK_RC(ac_ds_scaler_load(&b, &from), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "cur_scale must be a finite number > 0, got inf");
}

/* cur_iter at INT64_MAX (only a load puts it there): refused before anything changes, rather
 * than overflowing the counter */
TEST(counter_at_int64_max) {
  ac_ds_scaler_t s, from;
  CHECK_OK(ac_ds_scaler_init(&s, 8.0, 3, 1.0, 1, 0, 1, 1));
  from = s;
  from.cur_iter = INT64_MAX;
  CHECK_OK(ac_ds_scaler_load(&s, &from));
  ac_ds_scaler_t before = s;
  for (int f = 0; f <= 1; f++) {
    CHECK_RC(ac_ds_scaler_update(&s, f), AC_ERR_STATE);
    CHECK_CONTAINS(ac_last_error(), "cur_iter");
    CHECK(same_state(&s, &before));
  }
  /* one below: the last update that can be counted; stable = INT64_MAX - 1 fits */
  from.cur_iter = INT64_MAX - 1;
  CHECK_OK(ac_ds_scaler_load(&s, &from));
  CHECK_OK(ac_ds_scaler_update(&s, 0));
  CHECK(s.cur_iter == INT64_MAX);
}

/* Random configurations and overflow sequences. Every update is checked against what the rule
 * allows given the state before it, field by field (no second implementation of the rule). */
TEST(random_sequences_keep_invariants) {
  tu_rng_t rng = {0xd5eedULL};
  long errors = 0, growths = 0, lowerings = 0, absorbed = 0;
  for (int iter = 0; iter < 3000 && !tu_failed(); iter++) {
    int64_t window = 1 + (int64_t)tu_randn(&rng, 6), shift = 1 + (int64_t)tu_randn(&rng, 4);
    int consecutive = (int)tu_randn(&rng, 2), raise = tu_randn(&rng, 4) != 0;
    double init = ldexp(1.0, (int)tu_randn(&rng, 20) - 4); /* 2**-4 .. 2**15 */
    double min_scale = tu_randn(&rng, 4) == 0 ? 0.75 * init : ldexp(1.0, (int)tu_randn(&rng, 10) - 6);
    unsigned p_over = 1 + tu_randn(&rng, 6); /* overflow with probability p_over / 8 */
    ac_ds_scaler_t s;
    if (!CHECK_OK(ac_ds_scaler_init(&s, init, window, min_scale, shift, consecutive, 1, raise))) break;
    int lowered_once = 0;
    for (int k = 0; k < 200; k++) {
      int f = tu_randn(&rng, 8) < p_over;
      ac_ds_scaler_t b = s;
      ac_result_t r = ac_ds_scaler_update(&s, f);
      int lowers_now = f && (b.delayed_shift == 1 || b.cur_hysteresis == 1);
      if (r != AC_OK) {
        errors++;
        CHECK_MSG(r == AC_ERR_STATE && lowers_now && b.raise_at_min && b.cur_scale == b.min_scale,
                  "unexpected %s at step %d", ac_result_string(r), k);
        CHECK(same_state(&s, &b));
        continue;
      }
      /* fields that never change */
      CHECK(s.scale_window == b.scale_window && s.delayed_shift == b.delayed_shift && s.min_scale == b.min_scale &&
            s.scale_factor == 2.0 && s.consecutive_hysteresis == b.consecutive_hysteresis &&
            s.raise_at_min == b.raise_at_min && s.dynamic == 1);
      CHECK_EQ_INT(s.cur_iter, b.cur_iter + 1);
      CHECK(s.cur_hysteresis >= 1 && s.cur_hysteresis <= s.delayed_shift);
      CHECK(s.last_overflow_iter >= -1 && s.last_overflow_iter < s.cur_iter);
      if (f) {
        CHECK_EQ_INT(s.last_overflow_iter, b.cur_iter);
        if (lowers_now) {
          double want = fmax(b.cur_scale / 2.0, b.min_scale);
          CHECK_MSG(s.cur_scale == want, "lowering %g gave %g, want %g", b.cur_scale, s.cur_scale, want);
          CHECK_EQ_INT(s.cur_hysteresis, b.cur_hysteresis);
          CHECK(!(b.raise_at_min && b.cur_scale == b.min_scale));
          lowerings++;
          lowered_once = 1;
        } else {
          CHECK(s.cur_scale == b.cur_scale);
          CHECK_EQ_INT(s.cur_hysteresis, b.cur_hysteresis - 1);
          absorbed++;
        }
      } else {
        CHECK_EQ_INT(s.last_overflow_iter, b.last_overflow_iter);
        int64_t stable = b.cur_iter - b.last_overflow_iter - 1;
        int grows = stable > 0 && stable % b.scale_window == 0;
        CHECK_MSG(s.cur_scale == (grows ? 2.0 * b.cur_scale : b.cur_scale), "clean step %d: %g -> %g (stable %lld)",
                  k, b.cur_scale, s.cur_scale, (long long)stable);
        if (grows) growths++;
        if (consecutive || grows) CHECK_EQ_INT(s.cur_hysteresis, s.delayed_shift);
        else CHECK_EQ_INT(s.cur_hysteresis, b.cur_hysteresis);
      }
      /* the floor holds once the scale has been lowered (an init below it is DeepSpeed's choice) */
      if (lowered_once) CHECK(s.cur_scale >= s.min_scale);
    }
  }
  printf("random: %ld growths, %ld lowerings, %ld overflows absorbed, %ld errors at the floor\n", growths, lowerings,
         absorbed, errors);
  CHECK(growths > 0 && lowerings > 0 && absorbed > 0 && errors > 0);
}

static const tu_test_t tests[] = {
    TU_CASE(init_sets_deepspeeds_start),
    TU_CASE(growth_timing_window_3),
    TU_CASE(hysteresis_2_absorbs_one_overflow),
    TU_CASE(consecutive_vs_not_refill),
    TU_CASE(min_scale_clamp),
    TU_CASE(error_at_min_scale_leaves_state_unchanged),
    TU_CASE(static_mode_changes_nothing),
    TU_CASE(growth_unbounded_like_deepspeed),
    TU_CASE(bad_arguments_name_the_value),
    TU_CASE(load_round_trip_and_checks),
    TU_CASE(counter_at_int64_max),
    TU_CASE(random_sequences_keep_invariants),
};
TU_MAIN(tests)

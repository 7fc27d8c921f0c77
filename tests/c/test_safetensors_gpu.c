/* test_safetensors_gpu.c — GPU tensors in ac_st_save, staged through pinned buffers, against the
 * fake device of st_fake_device.h: files byte-identical to saves of the same bytes from host
 * memory (chunk edges, host and device pieces of two devices in one chunk, O_DIRECT refused),
 * failures while staging, waiting for the caller's ready events, and the argument checks of
 * device tensors. */
#define _GNU_SOURCE /* mkdtemp, setrlimit, memfd_create under -std=c11 */
#include <signal.h>
#include <sys/resource.h>

#include "st_fake_device.h"
#include "st_test_util.h"

/* Saves `t` (host tensors) as the reference, then again with the tensors whose index has a
 * non-negative dev[i] on that fake device, under ACCELERATE_C_DIRECT_IO=mode; checks the files
 * are byte-identical, the reported write mode, every device byte copied exactly once, and the
 * books. */
static void check_staged_same(const char *label, const ac_st_tensor_t *t, size_t n, const int *dev, const char *mode,
                              const char *want_mode, int threads) {
  char ref[512], out[512];
  path_of(ref, sizeof ref, "ref.safetensors");
  path_of(out, sizeof out, "staged.safetensors");
  setenv(DIO_ENV, "0", 1);
  CHECK_MSG(ac_st_save(ref, t, n, NULL, 0, 1) == AC_OK, "%s: %s", label, ac_last_error());
  ac_st_tensor_t *ts = malloc((n ? n : 1) * sizeof *ts);
  fake_range **owned = calloc(n ? n : 1, sizeof *owned);
  fake_reset();
  size_t dev_bytes = 0;
  for (size_t i = 0; i < n; i++) {
    ts[i] = t[i];
    if (dev[i] >= 0) {
      owned[i] = to_fake_device(&ts[i], dev[i]);
      size_t b = ac_st_dtype_size(t[i].dtype);
      for (int32_t d = 0; d < t[i].ndim; d++) b *= (size_t)t[i].shape[d];
      dev_bytes += b;
    }
  }
  setenv(DIO_ENV, mode, 1);
  CHECK_MSG(ac_st_save(out, ts, n, NULL, 0, threads) == AC_OK, "%s (%s=%s, threads %d): %s", label, DIO_ENV, mode,
            threads, ac_last_error());
  unsetenv(DIO_ENV);
  CHECK_MSG(strcmp(ac_st_last_write_mode(), want_mode) == 0, "%s (%s=%s): mode %s, expected %s", label, DIO_ENV, mode,
            ac_st_last_write_mode(), want_mode);
  size_t la = 0, lb = 0;
  unsigned char *a = read_whole(ref, &la), *b = read_whole(out, &lb);
  CHECK_MSG(a && b && la == lb, "%s: %zu bytes from host memory, %zu staged", label, la, lb);
  if (a && b && la == lb) {
    size_t i = 0;
    while (i < la && a[i] == b[i]) i++;
    CHECK_MSG(i == la, "%s (%s=%s, threads %d): first difference at byte %zu of %zu", label, DIO_ENV, mode, threads,
              i, la);
  }
  /* exactly once each; a refused first O_DIRECT write costs the copies of the chunks before it */
  if (st_direct_fault() == ST_DIRECT_FAULT_WRITE)
    CHECK_MSG(atomic_load(&fk_bytes) > dev_bytes, "%s: %zu device bytes copied, expected more than %zu", label,
              atomic_load(&fk_bytes), dev_bytes);
  else
    CHECK_MSG(atomic_load(&fk_bytes) == dev_bytes, "%s: %zu device bytes copied, expected %zu", label,
              atomic_load(&fk_bytes), dev_bytes);
  if (dev_bytes) CHECK(atomic_load(&fk_allocs) >= 1 && atomic_load(&fk_syncs) >= 1);
  check_fake_books(label);
  free(a);
  free(b);
  for (size_t i = 0; i < n; i++) free_fake_device(owned[i]);
  free(owned);
  free(ts);
  int temps;
  CHECK_EQ_INT(dir_count(&temps), 2);
  CHECK_EQ_INT(temps, 0);
  clear_dir();
}

TEST(gpu_tensors_staged_bytes_equal_host) {
  st_direct_set_device_ops(&fake_ops);
  if (!CHECK(st_direct_set_chunk_bytes(SMALL_CHUNK) == 0)) return;
  tu_rng_t rng = {0x6a0ULL};
  size_t cap = 8 * SMALL_CHUNK;
  unsigned char *data = malloc(cap);
  for (size_t i = 0; i < cap; i++) data[i] = (unsigned char)tu_rand32(&rng);
  static const char *const modes[][2] = {{"1", "direct"}, {"0", "buffered"}, {"auto", "buffered"}};

  /* one big tensor across several chunks, alone and next to host tensors in the same chunks */
  {
    int64_t s_big[1] = {3 * SMALL_CHUNK + 1001}, s_a[1] = {77}, s_b[2] = {5, 9};
    ac_st_tensor_t t[] = {
        {"big", AC_ST_U8, 1, s_big, data, AC_ST_HOST, 0},
        {"a.f32", AC_ST_F32, 1, s_a, data + 5, AC_ST_HOST, 0},
        {"b.bf16", AC_ST_BF16, 2, s_b, data + 7, AC_ST_HOST, 0},
    };
    const int all[] = {0, 0, 0}, big_only[] = {0, -1, -1}, small_only[] = {-1, 1, 3}, none[] = {-1, -1, -1};
    const int *cases[] = {all, big_only, small_only, none};
    for (int c = 0; c < 4; c++)
      for (int m = 0; m < 3; m++)
        for (int threads = 0; threads <= 4; threads += 2) {
          char label[64];
          snprintf(label, sizeof label, "big tensor, case %d", c);
          /* an all-host save is the plain writer: direct or pwritev, no staging */
          check_staged_same(label, t, 3, cases[c], modes[m][0], c == 3 && m == 2 ? "buffered" : modes[m][1], threads);
        }
  }

  /* files of exactly 1, 2 chunks (+-1 byte) from one device tensor */
  {
    const size_t lens[] = {SMALL_CHUNK, SMALL_CHUNK - 1, SMALL_CHUNK + 1, 2 * SMALL_CHUNK, 4096, 4095};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
      size_t n = lens[k] > 128 ? lens[k] - 128 : 1;
      for (int it = 0; it < 8; it++) {
        size_t len = u8_file_len(data, n);
        if (len == lens[k] || len == 0) break;
        n = n + lens[k] - len;
      }
      if (!CHECK_MSG(u8_file_len(data, n) == lens[k], "no tensor size gives a %zu-byte file", lens[k])) continue;
      int64_t shape[1] = {(int64_t)n};
      ac_st_tensor_t t = {"x", AC_ST_U8, 1, shape, data, AC_ST_HOST, 0};
      const int d[] = {2};
      char label[64];
      snprintf(label, sizeof label, "a %zu-byte file", lens[k]);
      for (int m = 0; m < 2; m++) check_staged_same(label, &t, 1, d, modes[m][0], modes[m][1], 2);
    }
  }

  /* tensors straddling chunk edges, host and device pieces (two devices) in one chunk, zero-size
   * device tensors and a device scalar */
  {
    int64_t s_f64[1] = {3001}, s_bf16[2] = {7, 111}, s_i8[1] = {13}, s_empty[2] = {0, 5}, s_u16[1] = {6000};
    static int64_t scalar = 0x0102030405060708LL;
    ac_st_tensor_t t[] = {
        {"w.f64", AC_ST_F64, 1, s_f64, data, AC_ST_HOST, 0},
        {"w.bf16", AC_ST_BF16, 2, s_bf16, data + 1, AC_ST_HOST, 0},
        {"w.i8", AC_ST_I8, 1, s_i8, data + 2, AC_ST_HOST, 0},
        {"empty.a", AC_ST_F32, 2, s_empty, NULL, AC_ST_HOST, 0},
        {"empty.b", AC_ST_U8, 2, s_empty, NULL, AC_ST_HOST, 0},
        {"step", AC_ST_I64, 0, NULL, &scalar, AC_ST_HOST, 0},
        {"w.u16", AC_ST_U16, 1, s_u16, data + 3, AC_ST_HOST, 0},
    };
    const int d1[] = {0, -1, 1, 0, -1, 1, -1}, d2[] = {-1, 2, -1, -1, 3, -1, 0}, d3[] = {1, 1, 1, 1, 1, 1, 1};
    const int *cases[] = {d1, d2, d3};
    for (int c = 0; c < 3; c++)
      for (int m = 0; m < 3; m++)
        for (int threads = 1; threads <= 16; threads *= 4)
          check_staged_same("straddling tensors", t, sizeof t / sizeof t[0], cases[c], modes[m][0], modes[m][1],
                            threads);
  }

  /* many tiny tensors alternating host / device 0 / device 1: dozens of pieces per chunk */
  {
    enum { N = 600 };
    ac_st_tensor_t *t = calloc(N, sizeof *t);
    int64_t *shapes = calloc(N, sizeof *shapes);
    int *dev = calloc(N, sizeof *dev);
    char (*names)[40] = calloc(N, sizeof *names);
    size_t off = 0;
    for (int i = 0; i < N; i++) {
      shapes[i] = i % 10 == 0 ? 0 : 1 + i % 7;
      snprintf(names[i], sizeof names[i], "model.layers.%03d.tiny_parameter", i);
      t[i] = (ac_st_tensor_t){names[i], AC_ST_U8, 1, &shapes[i], shapes[i] ? data + off : NULL, AC_ST_HOST, 0};
      dev[i] = i % 3 - 1;
      off += (size_t)shapes[i];
    }
    for (int m = 0; m < 2; m++) check_staged_same("600 tiny tensors", t, N, dev, modes[m][0], modes[m][1], 3);
    free(t);
    free(shapes);
    free(dev);
    free(names);
  }

  /* a file system that refuses O_DIRECT: "auto" (direct from 4 MiB) redoes the staged save
   * through the page cache, with the same bytes and every buffer of the first try freed */
  {
    size_t nbig = (size_t)4 << 20;
    unsigned char *big = malloc(nbig);
    for (size_t i = 0; i < nbig; i++) big[i] = (unsigned char)(i * 131 + (i >> 13));
    int64_t s_big[1] = {(int64_t)nbig}, s_a[1] = {33};
    ac_st_tensor_t t[] = {{"big", AC_ST_U8, 1, s_big, big, AC_ST_HOST, 0},
                          {"a", AC_ST_F32, 1, s_a, data, AC_ST_HOST, 0}};
    const int d[] = {0, -1};
    check_staged_same("4 MiB, auto", t, 2, d, "auto", "direct", 0);
    const int faults[] = {ST_DIRECT_FAULT_OPEN, ST_DIRECT_FAULT_WRITE};
    for (int k = 0; k < 2; k++) {
      st_direct_set_fault(faults[k]);
      check_staged_same("4 MiB, O_DIRECT refused", t, 2, d, "auto", "buffered", 0);
      st_direct_set_fault(ST_DIRECT_FAULT_NONE);
    }
    free(big);
  }
  free(data);
  CHECK(st_direct_set_chunk_bytes(0) == 0);
  st_direct_set_device_ops(NULL);
}

/* Failures while staging: a copy that cannot be queued, a wait that reports an error, no pinned
 * memory, a failed write. Each names the file and the tensor (and the device layer's text), leaves
 * no temporary file and the old file untouched, and frees every pinned buffer and stream. */
TEST(gpu_tensors_staging_failures) {
  st_direct_set_device_ops(&fake_ops);
  if (!CHECK(st_direct_set_chunk_bytes(SMALL_CHUNK) == 0)) return;
  char path[512];
  path_of(path, sizeof path, "fail.safetensors");
  static const char old[] = "the previous checkpoint";
  size_t nb = 5 * SMALL_CHUNK;
  unsigned char *host = malloc(nb);
  for (size_t i = 0; i < nb; i++) host[i] = (unsigned char)(i * 7 + (i >> 9));
  int64_t s_big[1] = {(int64_t)(4 * SMALL_CHUNK)}, s_small[1] = {1000}, s_tail[1] = {3000};
  static const char *const modes[] = {"1", "0"};
  int temps;
  for (int m = 0; m < 2; m++)
    for (int what = 0; what < 5; what++) {
      fake_reset();
      ac_st_tensor_t t[] = {
          {"layer.0.weight", AC_ST_U8, 1, s_big, host, AC_ST_HOST, 0},
          {"layer.1.bias", AC_ST_U8, 1, s_small, host + 11, AC_ST_HOST, 0},
          {"layer.2.scale", AC_ST_U8, 1, s_tail, host + 13, AC_ST_HOST, 0},
      };
      fake_range *d0 = to_fake_device(&t[0], 0), *d1 = to_fake_device(&t[1], 1);
      if (!d0 || !d1) break;
      const char *want[3] = {NULL, NULL, NULL};
      ac_result_t want_rc = AC_ERR_CUDA;
      struct rlimit saved, lim;
      int limited = 0;
      void (*prev)(int) = SIG_DFL;
      if (what == 0) { /* queueing the copy of the second device tensor fails */
        fk.fail_src = d1->p + 100;
        fk.fail_n = 1;
        want[0] = "copying tensor 'layer.1.bias' from CUDA device 1 into the staging buffer of";
        want[1] = "cudaMemcpyAsync (device 1 to host, 1000 bytes) failed: fake device fault";
      } else if (what == 1) { /* the first wait fails */
        fk.fail_sync = 1;
        want[0] = "from CUDA device ";
        want[1] = "cudaStreamSynchronize (device-to-host copies) on device";
        want[2] = "fake illegal address";
      } else if (what == 2) { /* no pinned memory at all */
        fk.fail_alloc = 1;
        want_rc = AC_ERR_NOMEM;
        want[0] = "no pinned staging buffer for";
        want[1] = "fake out of pinned memory";
      } else if (what == 3) { /* the file-size limit hits half-way */
        want_rc = AC_ERR_IO;
        want[0] = "writing tensor 'layer.0.weight' at file offset";
        want[1] = "File too large";
        getrlimit(RLIMIT_FSIZE, &saved);
        prev = signal(SIGXFSZ, SIG_IGN);
        lim = saved;
        lim.rlim_cur = 2 * SMALL_CHUNK;
        limited = setrlimit(RLIMIT_FSIZE, &lim) == 0;
        CHECK(limited);
      } else { /* only the second pinned buffer fails: one worker does it all */
        fk.fail_alloc = 2;
        want_rc = AC_OK;
      }
      write_whole(path, old, sizeof old);
      setenv(DIO_ENV, modes[m], 1);
      ac_result_t r = ac_st_save(path, t, 3, NULL, 0, 2);
      unsetenv(DIO_ENV);
      if (limited) {
        setrlimit(RLIMIT_FSIZE, &saved);
        signal(SIGXFSZ, prev);
      }
      char label[64];
      snprintf(label, sizeof label, "%s=%s, failure %d", DIO_ENV, modes[m], what);
      CHECK_MSG(r == want_rc, "%s: %s (%s)", label, ac_result_string(r), ac_last_error());
      size_t len = 0;
      unsigned char *now = read_whole(path, &len);
      if (want_rc != AC_OK) {
        CHECK_CONTAINS(ac_last_error(), "fail.safetensors: ");
        CHECK_CONTAINS(ac_last_error(), ".tmp");
        for (int k = 0; k < 3; k++)
          if (want[k]) CHECK_MSG(strstr(ac_last_error(), want[k]) != NULL, "%s: \"%s\" lacks \"%s\"", label,
                                 ac_last_error(), want[k]);
        CHECK_MSG(now && len == sizeof old && memcmp(now, old, len) == 0, "%s: the old file changed", label);
      } else {
        CHECK_EQ_INT(atomic_load(&fk_allocs), 2);
        ac_st_reader_t *rd;
        if (CHECK_OK(ac_st_reader_create(&rd, path))) {
          const ac_st_header_t *h = ac_st_reader_header(rd);
          size_t idx;
          CHECK_OK(ac_st_header_find(h, "layer.0.weight", &idx));
          unsigned char *back = malloc(4 * SMALL_CHUNK);
          ac_st_read_t q = {idx, back, 4 * SMALL_CHUNK};
          CHECK_OK(ac_st_reader_read(rd, &q, 1, 1));
          CHECK(memcmp(back, host, 4 * SMALL_CHUNK) == 0);
          free(back);
          ac_st_reader_destroy(rd);
        }
      }
      if (what == 1) {
        /* the wait names the first tensor queued on that device in the chunk */
        CHECK(strstr(ac_last_error(), "tensor 'layer.0.weight'") || strstr(ac_last_error(), "tensor 'layer.1.bias'"));
      }
      free(now);
      check_fake_books(label);
      CHECK_EQ_INT(dir_count(&temps), 1);
      CHECK_EQ_INT(temps, 0);
      free_fake_device(d0);
      free_fake_device(d1);
    }
  /* a sync failure covering several tensors of one device says how many */
  {
    fake_reset();
    int64_t s1[1] = {10};
    ac_st_tensor_t t[] = {{"p.a", AC_ST_U8, 1, s1, host, AC_ST_HOST, 0}, {"p.b", AC_ST_U8, 1, s1, host + 1, AC_ST_HOST, 0},
                          {"p.c", AC_ST_U8, 1, s1, host + 2, AC_ST_HOST, 0}};
    fake_range *d[3];
    for (int i = 0; i < 3; i++) d[i] = to_fake_device(&t[i], 2);
    fk.fail_sync = 1;
    CHECK_RC(ac_st_save(path, t, 3, NULL, 0, 0), AC_ERR_CUDA);
    CHECK_CONTAINS(ac_last_error(), "copying tensor 'p.a' (and 2 more of its chunk) from CUDA device 2");
    check_fake_books("three tensors, failed wait");
    for (int i = 0; i < 3; i++) free_fake_device(d[i]);
    CHECK_EQ_INT(dir_count(&temps), 1);
    CHECK_EQ_INT(temps, 0);
  }
  free(host);
  clear_dir();
  CHECK(st_direct_set_chunk_bytes(0) == 0);
  st_direct_set_device_ops(NULL);
}

/* Tensors still being written on the caller's stream when the save starts: with their ready
 * events (ac_st_save_after), every writer stream waits for the event of each device tensor
 * before copying any of its bytes, so the file holds the final bytes; a failed wait is an
 * error naming the tensor and the file, and leaves the old file. */
TEST(gpu_tensors_wait_for_the_callers_ready_event) {
  st_direct_set_device_ops(&fake_ops);
  if (!CHECK(st_direct_set_chunk_bytes(SMALL_CHUNK) == 0)) return;
  size_t nb = 6 * SMALL_CHUNK;
  unsigned char *host = malloc(nb);
  for (size_t i = 0; i < nb; i++) host[i] = (unsigned char)(i * 13 + (i >> 11));
  int64_t s_big[1] = {(int64_t)(3 * SMALL_CHUNK + 555)}, s_b[1] = {(int64_t)(SMALL_CHUNK + 7)}, s_c[1] = {999};
  const ac_st_tensor_t ref_t[] = {{"dev0.big", AC_ST_U8, 1, s_big, host, AC_ST_HOST, 0},
                                  {"dev1.b", AC_ST_U8, 1, s_b, host + 3, AC_ST_HOST, 0},
                                  {"host.c", AC_ST_U8, 1, s_c, host + 5, AC_ST_HOST, 0}};
  char ref[512], out[512];
  path_of(ref, sizeof ref, "ready_ref.safetensors");
  path_of(out, sizeof out, "ready.safetensors");
  setenv(DIO_ENV, "0", 1);
  CHECK_OK(ac_st_save(ref, ref_t, 3, NULL, 0, 1));
  size_t lref = 0;
  unsigned char *want = read_whole(ref, &lref);
  static const char *const modes[] = {"1", "0"};
  for (int m = 0; m < 2; m++)
    for (int threads = 1; threads <= 4; threads *= 2)
      for (int fail = 0; fail < 2; fail++) {
        fake_reset();
        ac_st_tensor_t t[3];
        memcpy(t, ref_t, sizeof t);
        fake_range *d0 = to_fake_device(&t[0], 0), *d1 = to_fake_device(&t[1], 1);
        fake_event *e0 = fake_pending_write(d0), *e1 = fake_pending_write(d1);
        void *ready[3] = {e0, e1, (void *)(uintptr_t)1}; /* a host tensor's entry is never used */
        fk.fail_wait = fail;
        static const char old[] = "the previous file";
        write_whole(out, old, sizeof old);
        setenv(DIO_ENV, modes[m], 1);
        ac_result_t r = ac_st_save_after(out, t, 3, NULL, 0, threads, ready);
        char label[96];
        snprintf(label, sizeof label, "%s=%s, threads %d%s", DIO_ENV, modes[m], threads, fail ? ", failed wait" : "");
        size_t len = 0;
        unsigned char *got = read_whole(out, &len);
        if (!fail) {
          CHECK_MSG(r == AC_OK, "%s: %s", label, ac_last_error());
          CHECK_MSG(got && want && len == lref && memcmp(got, want, len) == 0, "%s: the file differs from the final "
                    "bytes (copied before the caller's work was done?)", label);
          /* each stream that copied a tensor waited for its event, once */
          CHECK_MSG(atomic_load(&e0->waits) >= 1 && atomic_load(&e1->waits) >= 1, "%s: waits %d, %d", label,
                    atomic_load(&e0->waits), atomic_load(&e1->waits));
          CHECK_MSG(atomic_load(&e0->waits) <= threads && atomic_load(&e1->waits) <= threads, "%s: waits %d, %d",
                    label, atomic_load(&e0->waits), atomic_load(&e1->waits));
        } else {
          CHECK_MSG(r == AC_ERR_CUDA, "%s: %s", label, ac_result_string(r));
          CHECK_CONTAINS(ac_last_error(), "ready.safetensors: copying tensor 'dev");
          CHECK_CONTAINS(ac_last_error(), "cudaStreamWaitEvent (the tensors' ready event)");
          CHECK_MSG(got && len == sizeof old && memcmp(got, old, len) == 0, "%s: the old file changed", label);
        }
        check_fake_books(label);
        free(got);
        free_fake_event(e0);
        free_fake_event(e1);
        free_fake_device(d0);
        free_fake_device(d1);
        int temps;
        CHECK_EQ_INT(dir_count(&temps), 2);
        CHECK_EQ_INT(temps, 0);
      }
  unsetenv(DIO_ENV);
  free(want);
  free(host);
  clear_dir();
  CHECK(st_direct_set_chunk_bytes(0) == 0);
  st_direct_set_device_ops(NULL);
}

/* Argument checks of device tensors happen before any file exists. With the real CUDA layer of
 * this CPU-only build (cuda_stub.c), a device tensor is "built without CUDA". */
TEST(gpu_tensors_argument_errors) {
  char path[512];
  path_of(path, sizeof path, "dev.safetensors");
  static float x[4];
  int64_t s1[1] = {4};
  int temps;
  st_direct_set_device_ops(NULL);
  ac_st_tensor_t t = {"w", AC_ST_F32, 1, s1, x, AC_ST_CUDA, 0};
  for (int mode = 0; mode < 2; mode++) {
    setenv(DIO_ENV, mode ? "1" : "0", 1);
    CHECK_RC(ac_st_save(path, &t, 1, NULL, 0, 0), AC_ERR_UNSUPPORTED);
    CHECK_CONTAINS(ac_last_error(), "dev.safetensors: tensor 'w' is on CUDA device 0: accelerate_c was built "
                                    "without CUDA");
    CHECK_CONTAINS(ac_last_error(), "hint: reinstall with nvcc");
    CHECK_STREQ(ac_st_last_write_mode(), "none");
    CHECK_EQ_INT(dir_count(&temps), 0);
  }
  unsetenv(DIO_ENV);
  ac_st_tensor_t empty = {"e", AC_ST_F32, 1, (int64_t[]){0}, NULL, AC_ST_CUDA, 0};
  CHECK_RC(ac_st_save(path, &empty, 1, NULL, 0, 0), AC_ERR_UNSUPPORTED);
  ac_st_tensor_t bad_kind = {"k", AC_ST_F32, 1, s1, x, (ac_st_memory_t)7, 0};
  CHECK_RC(ac_st_save(path, &bad_kind, 1, NULL, 0, 0), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "tensor 'k' has an invalid memory kind 7");
  ac_st_tensor_t neg = {"n", AC_ST_F32, 1, s1, x, AC_ST_CUDA, -1};
  CHECK_RC(ac_st_save(path, &neg, 1, NULL, 0, 0), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "tensor 'n' has CUDA device -1");
  /* a device the (fake) driver does not have; a host tensor's device field is ignored */
  st_direct_set_device_ops(&fake_ops);
  fake_reset();
  ac_st_tensor_t two[] = {{"host", AC_ST_F32, 1, s1, x, AC_ST_HOST, 99}, {"far", AC_ST_F32, 1, s1, x, AC_ST_CUDA, 9}};
  CHECK_RC(ac_st_save(path, two, 2, NULL, 0, 0), AC_ERR_INVALID_ARG);
  CHECK_CONTAINS(ac_last_error(), "dev.safetensors: tensor 'far' is on CUDA device 9: CUDA device 9 does not exist");
  CHECK_EQ_INT(atomic_load(&fk_checks), 1);
  CHECK_EQ_INT(atomic_load(&fk_allocs), 0);
  CHECK_EQ_INT(dir_count(&temps), 0);
  st_direct_set_device_ops(NULL);
}

TEST(cleanup) { st_remove_tmpdir(); }

static const tu_test_t tests[] = {
    TU_CASE(gpu_tensors_staged_bytes_equal_host),
    TU_CASE(gpu_tensors_staging_failures),
    TU_CASE(gpu_tensors_wait_for_the_callers_ready_event),
    TU_CASE(gpu_tensors_argument_errors),
    TU_CASE(cleanup),
};
TU_MAIN(tests)

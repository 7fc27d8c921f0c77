#!/usr/bin/env bash
# Builds and runs the C unit tests of the core (CPU-only build: CUDA entry points come from
# cuda_stub.c) under AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer, and the
# concurrent parts' tests (TSAN_TESTS below) under ThreadSanitizer as well.
#
#   bash tests/c/run.sh            # from the repository root (or anywhere: it cds there)
#   CC=clang bash tests/c/run.sh   # another compiler
#   bash tests/c/run.sh pool       # only the test programs whose name contains "pool"
#   bash tests/c/run.sh safetensors kernels_ops   # several filters: programs matching any
#
# A suite too big for one file is several programs sharing a name prefix and a header
# (test_kernels_* with kernels_test_util.h, test_safetensors_* with st_test_util.h), so the
# prefix still selects all of it.
#
# Binaries go to tests/c/bin/ (git-ignored). Exits non-zero if any build or test fails.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

CC="${CC:-gcc}"
read -r -a CCV <<<"$CC" # CC may carry words, e.g. "ccache gcc"
BIN=tests/c/bin
CFLAGS=(-std=c11 -O1 -g -Wall -Wextra -Werror -ffp-contract=off -fsanitize=address,undefined -fno-omit-frame-pointer
        -fno-sanitize-recover=all -pthread -Icsrc/include -Icsrc/core)
# The CPU-only core: every csrc/core/*.c (error pool kernels kernels_scalar kernels_avx2
# cuda_stub, and whatever is added there later, e.g. scaler), so the whole core is also
# compiled with -Werror under the sanitizers. csrc/cuda and csrc/python are not part of it.
CORE=()
for f in csrc/core/*.c; do CORE+=("$(basename "$f" .c)"); done
for c in error pool kernels kernels_scalar kernels_avx2 cuda_stub; do
  [ -f "csrc/core/$c.c" ] || { echo "FAILED: csrc/core/$c.c is missing"; exit 1; }
done
TESTS=(test_error test_pool
       test_kernels_half test_kernels_ops test_kernels_reduce
       test_bucket test_shard test_ds_scaler
       test_safetensors_header test_safetensors_roundtrip test_safetensors_publish
       test_safetensors_direct test_safetensors_gpu
       test_comm test_comm_shm test_dlpack_check test_adam)

# LeakSanitizer is part of ASan on x86-64 Linux (gcc and clang); detect_leaks=1 makes it
# explicit. Caller-supplied options are kept (ours come first, theirs win).
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

status=0
t_start=$(date +%s.%N)
mkdir -p "$BIN/obj"

echo "== building the core with $CC ($("${CCV[@]}" --version 2>/dev/null | head -n 1))"
pids=()
for c in "${CORE[@]}"; do
  "${CCV[@]}" "${CFLAGS[@]}" -c "csrc/core/$c.c" -o "$BIN/obj/$c.o" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
if [ "$status" -ne 0 ]; then
  echo "FAILED: building the core"
  exit 1
fi
OBJS=()
for c in "${CORE[@]}"; do OBJS+=("$BIN/obj/$c.o"); done

# A stand-in libnccl (one rank, host memory) for test_comm: this machine has no NCCL or GPU.
if ! "${CCV[@]}" "${CFLAGS[@]}" -shared -fPIC tests/c/fake_nccl.c -o "$BIN/libfake_nccl.so"; then
  echo "FAILED: building tests/c/fake_nccl.c"
  exit 1
fi
export AC_FAKE_NCCL="$ROOT/$BIN/libfake_nccl.so"
# A stand-in for MKL's vmsSqrt for test_adam, built without sanitizers so that the ASan and the
# ThreadSanitizer builds of the test can both load it.
if ! "${CCV[@]}" -std=c11 -O1 -Wall -Wextra -Werror -shared -fPIC tests/c/fake_vml.c -lm -o "$BIN/libfake_vml.so"; then
  echo "FAILED: building tests/c/fake_vml.c"
  exit 1
fi
export AC_FAKE_VML="$ROOT/$BIN/libfake_vml.so"

selected=()
for t in "${TESTS[@]}"; do
  if [ "$#" -eq 0 ]; then
    selected+=("$t")
  else
    for f in "$@"; do
      case "$t" in *"$f"*) selected+=("$t"); break ;; esac
    done
  fi
done

if [ "${#selected[@]}" -eq 0 ]; then
  echo "FAILED: no test program matches: $*  (have: ${TESTS[*]})"
  exit 1
fi
echo "== building ${selected[*]}"
pids=()
for t in "${selected[@]}"; do
  rm -f "$BIN/$t"
  "${CCV[@]}" "${CFLAGS[@]}" "tests/c/$t.c" "${OBJS[@]}" -lm -o "$BIN/$t" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || status=1; done

results=()
run_one() { # label, then the command
  local label="$1"
  shift
  local t0 t1 rc
  t0=$(date +%s.%N)
  "$@"
  rc=$?
  t1=$(date +%s.%N)
  local secs
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" -eq 0 ]; then
    results+=("PASS  $label (${secs} s)")
  else
    results+=("FAIL  $label (exit $rc, ${secs} s)")
    status=1
  fi
}

for t in "${selected[@]}"; do
  if [ ! -x "$BIN/$t" ]; then
    results+=("FAIL  $t (did not build)")
    status=1
    continue
  fi
  run_one "$t" "$BIN/$t"
  echo
done

# The borrowed-OpenMP backend (csrc/core/pool.c): link the pool and kernel tests against
# libgomp, as torch's process is, and run them with AC_POOL_BACKEND=openmp; the tests check
# that the backend is in use and that a forked child falls back to the pthread workers.
for t in "${selected[@]}"; do
  case "$t" in test_pool | test_kernels_*) ;; *) continue ;; esac
  rm -f "$BIN/${t}_omp"
  if "${CCV[@]}" "${CFLAGS[@]}" -fopenmp "tests/c/$t.c" "${OBJS[@]}" -lm -o "$BIN/${t}_omp"; then
    echo "== AC_POOL_BACKEND=openmp $BIN/${t}_omp"
    run_one "$t with AC_POOL_BACKEND=openmp (libgomp linked)" env AC_POOL_BACKEND=openmp "$BIN/${t}_omp"
    echo
  else
    results+=("FAIL  ${t}_omp (did not build)")
    status=1
  fi
done

# The AC_KERNELS_ISA=scalar start-up override: the kernel ISA is chosen lazily on first use and
# cached, so only a fresh process shows it. The env-sensitive test (isa_default_and_env) runs
# first in test_kernels_ops and expects "scalar" here; the rest of the kernel programs run
# again too (they switch ISAs themselves with ac_kernels_set_isa, which overrides the
# environment).
for t in "${selected[@]}"; do
  case "$t" in test_kernels_*) ;; *) continue ;; esac
  if [ -x "$BIN/$t" ]; then
    echo "== AC_KERNELS_ISA=scalar $BIN/$t"
    run_one "$t with AC_KERNELS_ISA=scalar" env AC_KERNELS_ISA=scalar "$BIN/$t"
    echo
  fi
done

# ThreadSanitizer for the concurrent code (it cannot be combined with ASan): the shared-memory
# collectives, whose tests run ranks as threads, and the Adam kernels' split over the pool.
# Only what the program needs is compiled again, with -fsanitize=thread. (test_pool is not here: most of its cases fork a threaded process,
# which ThreadSanitizer does not support.)
TSAN_TESTS=(test_comm_shm test_adam)
for t in "${selected[@]}"; do
  case " ${TSAN_TESTS[*]} " in *" $t "*) ;; *) continue ;; esac
  rm -f "$BIN/${t}_tsan"
  srcs=(csrc/core/error.c)
  case "$t" in test_comm_shm) srcs+=(csrc/core/comm_shm.c csrc/core/comm_shm_reduce.c csrc/core/comm_shm_async.c csrc/core/comm_shm_window.c
                                      csrc/core/comm.c csrc/core/comm_shm_comm.c csrc/core/reducer.c csrc/core/bucket.c
                                      csrc/core/dtype.c csrc/core/cuda_stub.c) ;;
    test_adam) srcs+=(csrc/core/adam.c csrc/core/pool.c csrc/core/kernels.c csrc/core/kernels_scalar.c
                      csrc/core/kernels_avx2.c csrc/core/seg_norms.c csrc/core/dtype.c) ;; esac
  if "${CCV[@]}" -std=c11 -O1 -g -Wall -Wextra -Werror -ffp-contract=off -fsanitize=thread -fno-omit-frame-pointer -pthread \
      -Icsrc/include -Icsrc/core "tests/c/$t.c" "${srcs[@]}" -lm -ldl -o "$BIN/${t}_tsan"; then
    echo "== ThreadSanitizer $BIN/${t}_tsan"
    run_one "$t under ThreadSanitizer" env TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" "$BIN/${t}_tsan"
    echo
  else
    results+=("FAIL  ${t}_tsan (did not build)")
    status=1
  fi
done

t_end=$(date +%s.%N)
echo "== summary"
for r in "${results[@]}"; do echo "$r"; done
awk -v a="$t_start" -v b="$t_end" 'BEGIN { printf "total %.1f s\n", b - a }'
if [ "$status" -ne 0 ]; then
  echo "C TESTS FAILED"
else
  echo "all C tests passed"
fi
exit "$status"

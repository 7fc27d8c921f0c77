#!/usr/bin/env bash
# Bounded fuzzing of every C fuzz target (tests/c/fuzz_<target>.c), under AddressSanitizer + UBSan.
#
#   bash tests/c/fuzz.sh                 # 25 s in all, split evenly between the targets
#   bash tests/c/fuzz.sh 600             # a longer campaign (FUZZ_SECONDS, or the first argument)
#   bash tests/c/fuzz.sh 600 shard       # only the targets named (each gets SECONDS / count)
#   FUZZ_KEEP=0 bash tests/c/fuzz.sh 20  # the smoke run of `make test`: the tracked corpus is not touched
#   FUZZ_ENGINE=builtin bash tests/c/fuzz.sh   # force the built-in driver even where clang is present
#
# Targets (docs/security.md says what each checks beyond "no crash"):
#   safetensors  the safetensors header parser and layout check (st_json_parse.c, st_header.c)
#   shard        the shard plan and resharding arithmetic (shard.c) against its invariants
#   shm_header   the shared-memory collective's segment header as a garbage-writing peer leaves it
#   dlpack       the DLPack consumer's validation of producer-built tensors (dlpack_check.c)
#
# Engine: libFuzzer (clang -fsanitize=fuzzer) when clang has it, else the built-in coverage-guided
# driver (tests/c/fuzz_driver.c) built with $CC (gcc: -fsanitize-coverage=trace-pc). Seeds are
# tests/c/corpus/<target>/. With FUZZ_KEEP=1 (the default) an input that reaches new coverage is
# added there, so a long campaign grows the tracked corpus; with FUZZ_KEEP=0 new inputs go to
# tests/c/bin/fuzz/<target>/ (git-ignored). A crashing input is saved as
# tests/c/bin/fuzz/<target>/crash-*; replay it with the binary named in the failure message.
# Exits non-zero when a target fails to build or finds a crash.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

ALL_TARGETS=(safetensors shard shm_header dlpack)
SECS="${FUZZ_SECONDS:-25}"
if [ "$#" -gt 0 ] && [[ "$1" =~ ^[0-9]+([.][0-9]+)?$ ]]; then
  SECS="$1"
  shift
fi
if [ "$#" -gt 0 ]; then TARGETS=("$@"); else TARGETS=("${ALL_TARGETS[@]}"); fi
KEEP="${FUZZ_KEEP:-1}"
ENGINE="${FUZZ_ENGINE:-auto}"
OUT=tests/c/bin/fuzz
mkdir -p "$OUT"

# The core sources each target needs, no more (the rest of the core would pull in the CUDA layer).
target_srcs() {
  case "$1" in
    safetensors) echo csrc/core/st_header.c csrc/core/st_json_parse.c csrc/core/st_dtype.c csrc/core/st_text.c ;;
    shard) echo csrc/core/shard.c ;;
    shm_header) echo csrc/core/comm_shm_reduce.c ;; # the target includes comm_shm.c itself (to lay out a segment in checked memory)
    dlpack) echo csrc/core/dlpack_check.c ;;
    *) return 1 ;;
  esac
}
# Longest input: the JSON parser gets header-sized texts, the struct builders a few hundred bytes.
target_maxlen() {
  case "$1" in safetensors) echo 4096 ;; *) echo 512 ;; esac
}

COMMON=(-std=c11 -g -O1 -Wall -Wextra -Werror -fno-omit-frame-pointer -pthread -Icsrc/include -Icsrc/core)
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

libfuzzer_ok() {
  [ "$ENGINE" = builtin ] && return 1
  command -v clang >/dev/null 2>&1 || return 1
  echo 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }' \
    >"$OUT/probe.c"
  clang -fsanitize=fuzzer "$OUT/probe.c" -o "$OUT/probe" >/dev/null 2>&1
}
if libfuzzer_ok; then
  ENGINE=libfuzzer
else
  [ "$ENGINE" = libfuzzer ] && { echo "FAILED: FUZZ_ENGINE=libfuzzer but clang -fsanitize=fuzzer does not work"; exit 1; }
  ENGINE=builtin
fi
CC="${CC:-gcc}"
read -r -a CCV <<<"$CC"

# Build every selected target first (in parallel): a target that stops building fails the run.
status=0
declare -A BIN
pids=()
for t in "${TARGETS[@]}"; do
  srcs=$(target_srcs "$t") || { echo "FAILED: unknown fuzz target '$t' (have: ${ALL_TARGETS[*]})"; exit 1; }
  mkdir -p "$OUT/$t"
  if [ "$ENGINE" = libfuzzer ]; then
    BIN[$t]="$OUT/fuzz_$t"
    # functions a target leaves out of the coverage instrumentation (not of the sanitizers): the file says why
    ignore=()
    [ -f "tests/c/fuzz_$t.coverage-ignore" ] && ignore=("-fsanitize-coverage-ignorelist=tests/c/fuzz_$t.coverage-ignore")
    # shellcheck disable=SC2086
    clang "${COMMON[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all "${ignore[@]}" \
      "tests/c/fuzz_$t.c" $srcs csrc/core/error.c -lm -o "${BIN[$t]}" &
  else
    BIN[$t]="$OUT/fuzz_${t}_standalone"
    # The target and the code under test are instrumented for coverage; the driver is not (its
    # own loop would drown the signal).
    # shellcheck disable=SC2086
    ( "${CCV[@]}" "${COMMON[@]}" -fsanitize=address,undefined -fno-sanitize-recover=all -c tests/c/fuzz_driver.c \
        -o "$OUT/$t/driver.o" &&
      "${CCV[@]}" "${COMMON[@]}" -fsanitize=address,undefined -fno-sanitize-recover=all \
        -fsanitize-coverage=trace-pc "tests/c/fuzz_$t.c" $srcs csrc/core/error.c "$OUT/$t/driver.o" -lm \
        -o "${BIN[$t]}" ) &
  fi
  pids+=($!)
done
i=0
for t in "${TARGETS[@]}"; do
  wait "${pids[$i]}" || { echo "FAILED: building fuzz target $t ($ENGINE)"; status=1; }
  i=$((i + 1))
done
[ "$status" -ne 0 ] && exit 1

per=$(awk -v s="$SECS" -v n="${#TARGETS[@]}" 'BEGIN { v = s / n; if (v < 1) v = 1; printf "%d", v }')
echo "== fuzzing ${TARGETS[*]} with $ENGINE, ${per} s each"
results=()
for t in "${TARGETS[@]}"; do
  seeds="tests/c/corpus/$t"
  [ -d "$seeds" ] || { echo "FAILED: no seed corpus $seeds"; status=1; continue; }
  if [ "$KEEP" = 1 ]; then new="$seeds"; else new="$OUT/$t/new"; mkdir -p "$new"; fi
  dict=()
  [ -f "tests/c/corpus/$t.dict" ] && dict=("tests/c/corpus/$t.dict")
  log="$OUT/$t/last.log"
  t0=$(date +%s)
  if [ "$ENGINE" = libfuzzer ]; then
    # libFuzzer writes new inputs into the first directory; -rss_limit_mb bounds a runaway allocation.
    # shellcheck disable=SC2068
    "${BIN[$t]}" -max_total_time="$per" -max_len="$(target_maxlen "$t")" -rss_limit_mb=2048 -timeout=10 \
      ${dict[@]/#/-dict=} -artifact_prefix="$OUT/$t/" -print_final_stats=1 "$new" "$seeds" >"$log" 2>&1
    rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  else
    # shellcheck disable=SC2068
    "${BIN[$t]}" -t "$per" -m "$(target_maxlen "$t")" -o "$new" -a "$OUT/$t/" ${dict[@]/#/-x } "$seeds" >"$log" 2>&1
    rc=$?
    execs=$(sed -n 's/^standalone fuzz: \([0-9]*\) executions.*/\1/p' "$log" | tail -n 1)
  fi
  t1=$(date +%s)
  # one line per run, so docs/security.md's totals can be summed from the log
  echo "$(date -u +%FT%TZ) $t $ENGINE ${execs:-?} execs $((t1 - t0)) s rc=$rc" >>"$OUT/runs.log"
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$log"
    results+=("FAIL  $t: exit $rc after ${execs:-?} executions; input under $OUT/$t/ (replay: ${BIN[$t]} $([ "$ENGINE" = builtin ] && echo '-r ')FILE)")
    status=1
  else
    results+=("PASS  $t: ${execs:-?} executions in $((t1 - t0)) s")
  fi
done
echo "== fuzz summary ($ENGINE)"
for r in "${results[@]}"; do echo "$r"; done
if [ "$status" -ne 0 ]; then echo "FUZZ FAILED"; else echo "fuzz run finished without a crash"; fi
exit "$status"

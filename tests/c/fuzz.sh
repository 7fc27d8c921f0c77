#!/usr/bin/env bash
# Bounded fuzzing of the safetensors header parser (tests/c/fuzz_safetensors.c).
#
#   bash tests/c/fuzz.sh            # 25 s (FUZZ_SECONDS or the first argument change it)
#   bash tests/c/fuzz.sh 300        # a longer run
#
# With clang's libFuzzer (clang -fsanitize=fuzzer) it runs a coverage-guided libFuzzer campaign
# under AddressSanitizer + UBSan; otherwise it builds the target's own random-mutation driver
# (-DAC_FUZZ_STANDALONE) with $CC and the same sanitizers. The seeds in
# tests/c/corpus/safetensors/ are never modified: new inputs go to tests/c/bin/fuzz/corpus/
# (git-ignored), and a crashing input is saved under tests/c/bin/fuzz/. Exits non-zero on a crash.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

SECS="${1:-${FUZZ_SECONDS:-25}}"
OUT=tests/c/bin/fuzz
SEEDS=tests/c/corpus/safetensors
DICT=tests/c/corpus/safetensors.dict
# The parser and what it needs, nothing of the writer or the reader (which would pull in
# durable.c, st_direct.c and the CUDA layer).
SRCS=(tests/c/fuzz_safetensors.c csrc/core/st_header.c csrc/core/st_json_parse.c csrc/core/st_dtype.c
      csrc/core/st_text.c csrc/core/error.c)
COMMON=(-std=c11 -g -O1 -Wall -Wextra -Werror -fno-omit-frame-pointer -pthread -Icsrc/include)
mkdir -p "$OUT/corpus"

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

libfuzzer_ok() {
  command -v clang >/dev/null 2>&1 || return 1
  echo 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }' \
    >"$OUT/probe.c"
  clang -fsanitize=fuzzer "$OUT/probe.c" -o "$OUT/probe" >/dev/null 2>&1
}

if libfuzzer_ok; then
  echo "== libFuzzer (clang): fuzz_safetensors for ${SECS} s"
  clang "${COMMON[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    "${SRCS[@]}" -o "$OUT/fuzz_safetensors" || { echo "FAILED: building the libFuzzer target"; exit 1; }
  # -rss_limit_mb bounds a runaway allocation; -max_len keeps inputs header-sized.
  "$OUT/fuzz_safetensors" -max_total_time="$SECS" -max_len=4096 -rss_limit_mb=2048 -timeout=10 \
    -dict="$DICT" -artifact_prefix="$OUT/" -print_final_stats=1 "$OUT/corpus" "$SEEDS"
  rc=$?
else
  CC="${CC:-gcc}"
  echo "== clang with libFuzzer not found: standalone mutation driver built with $CC for ${SECS} s"
  $CC "${COMMON[@]}" -DAC_FUZZ_STANDALONE -fsanitize=address,undefined -fno-sanitize-recover=all \
    "${SRCS[@]}" -o "$OUT/fuzz_safetensors_standalone" || { echo "FAILED: building the fuzz driver"; exit 1; }
  "$OUT/fuzz_safetensors_standalone" "$SECS" "$SEEDS" "$DICT"
  rc=$?
fi
if [ "$rc" -ne 0 ]; then
  echo "FUZZ FAILED (exit $rc): see the crash input under $OUT/"
else
  echo "fuzz run finished without a crash"
fi
exit "$rc"

#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang-14 with ASan+UBSan; build tree <root>/fuzz) and
# runs one of them, or all, for SECONDS each on a copy of its seed corpus (tests/fuzz/corpus/NAME;
# the seeds in the repository are never modified). Prints each run's executions; exits non-zero at
# the first crash, leak or sanitizer report (the reproducer is left in the printed directory: make
# it a regression test, docs/fuzzing.md).
#   scripts/fuzz.sh list                 the targets
#   scripts/fuzz.sh TARGET|all SECONDS   e.g. scripts/fuzz.sh tokenizer_encode 60
#                                        (TARGET may list several: gguf,chat_template)
# Environment: HMOE_BUILD_ROOT (default <repo>/build), HMOE_JOBS (default nproc),
#   HMOE_FUZZ_WORKDIR (default <root>/fuzz-runs), HMOE_FUZZ_ARGS (extra libFuzzer flags).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_ROOT="${HMOE_BUILD_ROOT:-$ROOT/build}"
BUILD="$BUILD_ROOT/fuzz"
JOBS="${HMOE_JOBS:-$(nproc)}"
WORK="${HMOE_FUZZ_WORKDIR:-$BUILD_ROOT/fuzz-runs}"
TARGETS=(safetensors model_config checkpoint_index tokenizer_json tokenizer_encode shm_manifest
  request_validator gguf chat_template tiktoken)

usage() {
  echo "usage: scripts/fuzz.sh list | TARGET[,TARGET...]|all SECONDS   (targets: ${TARGETS[*]})" >&2
  exit 2
}
[[ $# -ge 1 ]] || usage
if [[ "$1" == list ]]; then
  printf '%s\n' "${TARGETS[@]}"
  exit 0
fi
[[ $# -eq 2 && "$2" =~ ^[0-9]+$ && "$2" -gt 0 ]] || usage
IFS=, read -r -a WANT <<<"$1"  # one target, several separated by commas, or all
[[ "$1" == all ]] && WANT=("${TARGETS[@]}")
for t in "${WANT[@]}"; do
  [[ " ${TARGETS[*]} " == *" $t "* ]] || {
    echo "fuzz.sh: unknown target '$t'" >&2
    usage
  }
done

CXX_BIN="$(command -v clang++-14 || true)"
C_BIN="$(command -v clang-14 || true)"
if [[ -z "$CXX_BIN" || -z "$C_BIN" ]]; then
  echo "fuzz.sh: clang-14 is missing (scripts/setup-deps.sh installs clang-14 and libfuzzer-14-dev)" >&2
  exit 1
fi
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}" CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1
mkdir -p "$BUILD_ROOT"
if [[ ! -f "$BUILD/build.ninja" ]]; then
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_C_COMPILER="$C_BIN" -DCMAKE_CXX_COMPILER="$CXX_BIN" \
    -DHMOE_FUZZ=ON -DHMOE_CUDA=OFF -DHMOE_BUILD_TESTS=OFF -DHMOE_BUILD_BENCHMARKS=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$BUILD.configure.log" 2>&1 || {
    cat "$BUILD.configure.log"
    exit 1
  }
fi
cmake --build "$BUILD" -j "$JOBS" --target "${WANT[@]/%/_fuzzer}"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
for t in "${WANT[@]}"; do
  dir="$WORK/$t"
  rm -rf "$dir"
  mkdir -p "$dir/corpus" "$dir/artifacts"
  cp "$ROOT/tests/fuzz/corpus/$t/"* "$dir/corpus/"
  echo "==== fuzz $t for $2 s (corpus and crashes in $dir)"
  # -rss_limit_mb: inputs are at most 64 KiB; a parser that needs more than 2 GiB for one is a bug.
  t0=$SECONDS
  # shellcheck disable=SC2086
  if ! "$BUILD/tests/fuzz/${t}_fuzzer" "$dir/corpus" -max_total_time="$2" -max_len=65536 \
    -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 -artifact_prefix="$dir/artifacts/" \
    ${HMOE_FUZZ_ARGS:-} >"$dir/log.txt" 2>&1; then
    tail -n 60 "$dir/log.txt"
    echo "fuzz.sh: $t FAILED: reproducer(s) in $dir/artifacts/" >&2
    exit 1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$dir/log.txt" | grep -o '[0-9]*$' || true)
  echo "fuzz $t: ${runs:-?} executions in $((SECONDS - t0)) s, no crash ($(find "$dir/corpus" -type f | wc -l) corpus files)"
done

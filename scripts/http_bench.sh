#!/usr/bin/env bash
# The OpenAI HTTP API against the gRPC API on one deployed stack (issue #17 acceptance 6,
# docs/PERFORMANCE.md "HTTP vs gRPC"): deploys the stack the way scripts/quickstart.sh does
# (`hmoe deploy` + supervisord: hmoe-weightd, the decode worker and hmoe-router with HTTP on) on
# the `tiny` demo model, CPU only, no prefill worker, then runs `hmoe http-bench`:
#   1. SAMPLES pairs of identical requests (random 8-16 token-id prompts, NEW tokens, greedy), one
#      at a time, HTTP (/v1/completions, SSE) and gRPC (Generate) alternating: TTFT p50/p90 of
#      each, measured by the same C++ tool from sending the request to the first token with text;
#   2. STREAMS concurrent SSE streams of STREAM_TOKENS tokens each: completed, errors, wall time.
# Prints the CPU model and the load average before and after.
#
#   scripts/http_bench.sh [SAMPLES] [STREAMS] [STREAM_TOKENS] [NEW]   (defaults 200 64 32 1)
#
# Environment: HMOE_BUILD_ROOT (default <repo>/build; uses <root>/cpu, building what it lacks),
# HMOE_BENCH_DIR (model, deployment, logs; default <root>/http_bench), HMOE_MODEL_PRESET (tiny),
# HMOE_JOBS (build jobs).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SAMPLES="${1:-200}"
STREAMS="${2:-64}"
STREAM_TOKENS="${3:-32}"
NEW="${4:-1}"
BUILD_ROOT="${HMOE_BUILD_ROOT:-$ROOT/build}"
BUILD="$BUILD_ROOT/cpu"
DIR="${HMOE_BENCH_DIR:-$BUILD_ROOT/http_bench}"
PRESET="${HMOE_MODEL_PRESET:-tiny}"
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"

export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}" CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1
if [[ ! -f "$BUILD/build.ninja" ]]; then
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DHMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$BUILD" -j "${HMOE_JOBS:-$(nproc)}" --target hmoe-weightd hmoe-decode-worker \
  hmoe-router hmoe hmoe-make-model >/dev/null
HMOE="$BUILD/tools/hmoe"

mkdir -p "$DIR"
if [[ ! -f "$DIR/$PRESET/config.json" ]]; then
  "$BUILD/tools/hmoe-make-model" --preset "$PRESET" --out "$DIR/$PRESET" >/dev/null 2>&1
fi
INSTANCE="httpbench-$$"
RUN_DIR="/tmp/hmoe-httpbench-$(id -u)-$$"
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
ADDR="127.0.0.1:$(free_port)"
HTTP="127.0.0.1:$(free_port)"
DEPLOY="$DIR/deploy"
rm -rf "$DEPLOY"
CONF="$DEPLOY/supervisord.conf"
"$HMOE" deploy --model "$DIR/$PRESET" --out "$DEPLOY" --run-dir "$RUN_DIR" --gpus 0 \
  --prefill-workers 0 --listen "$ADDR" --http-listen "$HTTP" --instance "$INSTANCE" \
  --bin-dir "$BUILD" >/dev/null
cleanup() {
  stop_supervisord "$CONF" "$RUN_DIR"
  rm -f /dev/shm/hmoe."$INSTANCE".*
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT
echo "http_bench: starting the stack ($PRESET; gRPC $ADDR, HTTP $HTTP; logs in $DEPLOY/logs)"
supervisord -c "$CONF"
wait_for_stack "$HMOE" "$ADDR" "$CONF" "$DEPLOY/logs" || exit 2
echo "http_bench: CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')," \
  "$(nproc) cores; load: $(uptime | sed 's/.*load average: //')"
rc=0
"$HMOE" http-bench --addr "$ADDR" --http-addr "$HTTP" --samples "$SAMPLES" --streams "$STREAMS" \
  --stream-tokens "$STREAM_TOKENS" --max-new-tokens "$NEW" || rc=$?
echo "http_bench: load at the end: $(uptime | sed 's/.*load average: //')"
exit "$rc"

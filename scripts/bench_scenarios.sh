#!/usr/bin/env bash
# The paper's concurrency scenarios (Fig. 18: 1P, 1D, 1P+1D, 2D, 1P+2D) on one node configuration
# (docs/bench.md, docs/PERFORMANCE.md "Concurrency scenarios"): deploys MODEL with `hmoe deploy`
# and PREFILL_WORKERS prefill workers (0: chunked prefill on the decode worker only) under
# supervisord, waits until it serves, runs `hmoe bench --scenario all`, writes the JSON to OUT and
# stops the service.
#
#   scripts/bench_scenarios.sh MODEL PREFILL_WORKERS OUT.json [hmoe bench flags...]
#     e.g. scripts/bench_scenarios.sh out/small 1 docs/data/bench-small-pd.json --target-s 10
# Environment: HMOE_BUILD (default <repo>/build/cpu), HMOE_BENCH_PORT (default 50061),
#   HMOE_DECODE_ARGS (extra hmoe-decode-worker flags, e.g. "--dual-batch on").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HMOE_BUILD:-$ROOT/build/cpu}"
HMOE="$BUILD/tools/hmoe"
if [[ $# -lt 3 ]]; then
  echo "usage: $0 MODEL PREFILL_WORKERS OUT.json [hmoe bench flags...]" >&2
  exit 2
fi
MODEL="$1"
PREFILL="$2"
OUT="$3"
shift 3
PORT="${HMOE_BENCH_PORT:-50061}"
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"
require_client bench_scenarios "$HMOE"
DEPLOY="$(mktemp -d "${TMPDIR:-/tmp}/hmoe-bench.XXXXXX")"
CONF="$DEPLOY/supervisord.conf"
cleanup() {
  stop_supervisord "$CONF" "$DEPLOY/run"
  rm -rf "$DEPLOY"
}
trap cleanup EXIT
start_stack "$HMOE" "$BUILD" "$MODEL" "$DEPLOY" "$PORT" "$PREFILL" "bench-$$" \
  "${HMOE_DECODE_ARGS:-}"
"$HMOE" status --addr "127.0.0.1:$PORT"
"$HMOE" bench --addr "127.0.0.1:$PORT" --scenario all --json "$OUT" --timeout-s 3600 "$@"

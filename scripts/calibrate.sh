#!/usr/bin/env bash
# Calibrates the router's thresholds on this node (docs/bench.md "Calibration"): deploys MODEL with
# `hmoe deploy` and PREFILL_WORKERS prefill workers (default 1; SLP needs one) under supervisord,
# waits until it serves, runs `hmoe calibrate`, writes the calibration file OUT.json and stops the
# service. Then deploy the node for real with `hmoe deploy ... --calibration OUT.json`.
#
#   scripts/calibrate.sh MODEL OUT.json [hmoe calibrate flags...]
#     e.g. scripts/calibrate.sh out/small node.json --lengths 32,64,128,256,512 --repeats 3
# Environment: HMOE_BUILD (default <repo>/build/cpu), HMOE_BENCH_PORT (default 50062),
#   HMOE_PREFILL_WORKERS (default 1), HMOE_DECODE_ARGS / HMOE_PREFILL_ARGS (extra worker flags:
#   calibrate the configuration you will deploy).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HMOE_BUILD:-$ROOT/build/cpu}"
HMOE="$BUILD/tools/hmoe"
if [[ $# -lt 2 ]]; then
  echo "usage: $0 MODEL OUT.json [hmoe calibrate flags...]" >&2
  exit 2
fi
MODEL="$1"
OUT="$2"
shift 2
PORT="${HMOE_BENCH_PORT:-50062}"
PREFILL="${HMOE_PREFILL_WORKERS:-1}"
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"
require_client calibrate "$HMOE"
if [[ "$PREFILL" -lt 1 ]]; then
  echo "calibrate: HMOE_PREFILL_WORKERS must be >= 1 (SLP runs on a prefill worker)" >&2
  exit 2
fi
DEPLOY="$(mktemp -d "${TMPDIR:-/tmp}/hmoe-calibrate.XXXXXX")"
CONF="$DEPLOY/supervisord.conf"
cleanup() {
  stop_supervisord "$CONF" "$DEPLOY/run"
  rm -rf "$DEPLOY"
}
trap cleanup EXIT
start_stack "$HMOE" "$BUILD" "$MODEL" "$DEPLOY" "$PORT" "$PREFILL" "calibrate-$$" \
  "${HMOE_DECODE_ARGS:-}" "${HMOE_PREFILL_ARGS:-}"
"$HMOE" status --addr "127.0.0.1:$PORT"
"$HMOE" calibrate --addr "127.0.0.1:$PORT" --calibration "$OUT" --timeout-s 3600 "$@"

#!/usr/bin/env bash
# Fairness of chunked prefill (issue #16 acceptance 5, docs/PERFORMANCE.md "Chunked prefill
# fairness"): the TTFT of a 4-token request while a long prompt is prefilled on the chunked path
# of the decode worker, against the same request's TTFT on an idle service and the time of one
# prefill chunk. Runs against a running service with no other load:
#
#   scripts/fairness_ttft.sh [ROUNDS] [ADDR] [LONG_TOKENS] [CHUNK]
#       (defaults 3, 127.0.0.1:50051, 4096, 512 = the decode worker's --chunk-size;
#        env HMOE: the client, default build/cpu/tools/hmoe)
#
# Each round: the short request alone (idle TTFT), then the long prompt (--hint chunked, 1 new
# token) and, once it has run for a second, the short request again (TTFT under the prefill).
# The long prompt's TTFT divided by its chunk count estimates one chunk's time. Prints per round:
# idle, loaded, chunk, and the bound 3 x idle + chunk.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HMOE="${HMOE:-$ROOT/build/cpu/tools/hmoe}"
ROUNDS="${1:-3}"
ADDR="${2:-127.0.0.1:50051}"
LONG="${3:-4096}"
CHUNK="${4:-512}"
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"
require_client fairness_ttft "$HMOE"
OUT="$(mktemp -d "${TMPDIR:-/tmp}/hmoe-fairness.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT
# Token ids 10..2009 repeated (within any vocabulary of the demo models).
long_ids=$(seq 0 $((LONG - 1)) | awk '{printf "%s%d", (NR > 1 ? "," : ""), 10 + $1 % 2000}')
short() {
  "$HMOE" generate --addr "$ADDR" --prompt-ids 5,6,7,8 --max-new-tokens 1 --hint chunked \
    >"$1" 2>&1
}
for round in $(seq 1 "$ROUNDS"); do
  short "$OUT/idle"
  "$HMOE" generate --addr "$ADDR" --prompt-ids "$long_ids" --max-new-tokens 1 --hint chunked \
    --timeout-s 3600 >"$OUT/long" 2>&1 &
  long_pid=$!
  sleep 1
  short "$OUT/loaded"
  wait "$long_pid" || true  # its output says whether it failed
  idle=$(ttft_ms fairness_ttft "$OUT/idle")
  loaded=$(ttft_ms fairness_ttft "$OUT/loaded")
  long=$(ttft_ms fairness_ttft "$OUT/long")
  awk -v r="$round" -v i="$idle" -v l="$loaded" -v g="$long" -v n="$LONG" -v c="$CHUNK" 'BEGIN {
    chunks = int((n + c - 1) / c); chunk = g / chunks
    printf "round %d: idle %.1f ms, under a %d-token prefill %.1f ms, chunk %.1f ms (long TTFT %.1f / %d), bound 3 x idle + chunk %.1f ms: %s\n",
      r, i, n, l, chunk, g, chunks, 3 * i + chunk, (l < 3 * i + chunk ? "within" : "OVER") }'
done

#!/usr/bin/env bash
# TTFT of one 512-token prompt through the router on a CPU-only stack (issue #15 acceptance 4):
# weightd, one decode worker (2 threads, chunked prefill: 512 < the router's --chunk-threshold)
# and the router from BIN_DIR on MODEL; one request of 512 token ids, one new token; prints the
# TTFT and the load average, then stops the stack and removes its directory (KEEP=1 keeps it).
#
#   scripts/prefill_ttft.sh MODEL BIN_DIR PORT TAG
#   e.g. scripts/prefill_ttft.sh out/real-shaped build/cpu 50095 after
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="$1"; BIN_DIR="$2"; PORT="$3"; TAG="$4"
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"
HMOE="$BIN_DIR/tools/hmoe"
require_client prefill_ttft "$HMOE"
OUT="$(mktemp -d "${TMPDIR:-/tmp}/hmoe-ttft-$TAG.XXXXXX")"
# The stack's files (logs, sockets, the generation's output) go with it unless KEEP=1.
trap 'stop_supervisord "$OUT/supervisord.conf" "$OUT/run"; [[ "${KEEP:-0}" == 1 ]] || rm -rf "$OUT"' EXIT
start_stack "$HMOE" "$BIN_DIR" "$MODEL" "$OUT" "$PORT" 0 "ttft-$TAG-$$" "--threads=2" || exit 1
IDS=$(seq 0 511 | awk '{printf "%s%d", (NR > 1 ? "," : ""), ($1 * 7919) % 3000 + 10}')
"$HMOE" generate --addr "127.0.0.1:$PORT" --prompt-ids "$IDS" --max-new-tokens 1 \
  --timeout-s 1800 >"$OUT/gen.out" 2>&1
echo "$TAG TTFT $(ttft_ms prefill_ttft "$OUT/gen.out") ms; load $(cut -d' ' -f1-3 /proc/loadavg)"

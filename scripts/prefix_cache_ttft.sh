#!/usr/bin/env bash
# TTFT of a short question after a long shared prefix, prefix cache on vs off (issue 23
# acceptance 2), on a CPU-only stack: weightd, one decode worker (2 threads; no prefill worker, so
# every prompt is prefilled in chunks on the decode worker) and the router from BIN_DIR on MODEL.
# Requests, one new token each, one after the other:
#   cold  prefix + question 1, cache on (the cache is empty: the whole prompt is prefilled; its KV
#         joins the cache)
#   hit   prefix + question 2, cache on (the prefix is reused, only the question is prefilled)
#   off   prefix + question 3, cache_prompt false (the whole prompt again)
#   hit2  prefix + question 4, cache on
# Prints each TTFT, the cached tokens, hit / off and the load average, then stops the stack.
#
# With PREFILL_WORKERS=1 the stack has a CPU prefill worker too (the router's --chunk-threshold
# is CHUNK_THRESHOLD, default 256, and --cpu-devices-shared=false so the policy may use it while
# the decode worker is idle): a long question then goes to the prefill worker, which on a hit
# gets the prefix's KV from the decode worker's cache and prefills only the question; off and
# cold prefill the whole prompt there.
#
#   [PREFILL_WORKERS=1] scripts/prefix_cache_ttft.sh MODEL BIN_DIR PORT [PREFIX_TOKENS] [QUESTION_TOKENS]
#   e.g. scripts/prefix_cache_ttft.sh out/small build/cpu 50097 4096 16
#        PREFILL_WORKERS=1 scripts/prefix_cache_ttft.sh out/small build/cpu 50097 4096 1024
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="$1"; BIN_DIR="$2"; PORT="$3"; PREFIX="${4:-4096}"; QUESTION="${5:-16}"
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"
HMOE="$BIN_DIR/tools/hmoe"
require_client prefix_cache_ttft "$HMOE"
OUT="$(mktemp -d "${TMPDIR:-/tmp}/hmoe-prefix-ttft.XXXXXX")"
PREFILL_WORKERS="${PREFILL_WORKERS:-0}"
ROUTER_ARGS=""
if [[ "$PREFILL_WORKERS" != 0 ]]; then
  ROUTER_ARGS="--chunk-threshold=${CHUNK_THRESHOLD:-256} --cpu-devices-shared=false"
fi
trap 'stop_supervisord "$OUT/supervisord.conf" "$OUT/run"; rm -rf "$OUT"' EXIT
start_stack "$HMOE" "$BIN_DIR" "$MODEL" "$OUT" "$PORT" "$PREFILL_WORKERS" "prefix-ttft-$$" \
  "--threads=2" "--threads=2 --pin-threads=false" "$ROUTER_ARGS" || exit 1
ids() {  # ids COUNT SEED: COUNT token ids from a fixed sequence
  seq 0 $(($1 - 1)) | awk -v s="$2" '{printf "%s%d", (NR > 1 ? "," : ""), ($1 * 7919 + s * 104729) % 3000 + 10}'
}
PREFIX_IDS=$(ids "$PREFIX" 1)
run() {  # run NAME SEED CACHE
  "$HMOE" generate --addr "127.0.0.1:$PORT" --prompt-ids "$PREFIX_IDS,$(ids "$QUESTION" "$2")" \
    --max-new-tokens 1 --cache-prompt="$3" --timeout-s 3600 >"$OUT/$1.out" 2>&1
  local t c p
  t=$(ttft_ms prefix_cache_ttft "$OUT/$1.out")
  c=$(grep -o '([0-9]* cached)' "$OUT/$1.out" | tr -dc 0-9)
  p=$(grep -m1 -o 'path [A-Z_]*' "$OUT/$1.out" | cut -d' ' -f2)
  echo "$1 $t ${c:-0} ${p:-?}"
}
COLD=$(run cold 2 true) || exit 1
HIT=$(run hit 3 true) || exit 1
OFF=$(run off 4 false) || exit 1
HIT2=$(run hit2 5 true) || exit 1
echo "model $(basename "$MODEL"), prefix $PREFIX + question $QUESTION tokens," \
  "$PREFILL_WORKERS prefill worker(s)," \
  "CPU $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
for r in "$COLD" "$HIT" "$OFF" "$HIT2"; do
  read -r name t c p <<<"$r"
  printf '  %-5s TTFT %10.1f ms  cached %s tokens  path %s\n' "$name" "$t" "$c" "$p"
done
read -r _ thit _ <<<"$HIT"; read -r _ toff _ <<<"$OFF"; read -r _ thit2 _ <<<"$HIT2"
awk -v a="$toff" -v b="$thit" -v c="$thit2" \
  'BEGIN { printf "  off / hit: %.1fx and %.1fx\n", a / b, a / c }'
echo "  load $(cut -d' ' -f1-3 /proc/loadavg)"

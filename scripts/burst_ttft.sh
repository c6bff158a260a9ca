#!/usr/bin/env bash
# TTFT of a burst of six concurrent short prompts through a running service (docs/PERFORMANCE.md
# "Prefill packing"). Each round starts six `hmoe generate` clients at once
# (prompts of 5-38 tokens, 8 new tokens) and prints their TTFTs in ms, sorted, then the mean and
# the largest.
#
#   HMOE_KEEP_RUNNING=1 HMOE_MODEL_DIR=out/real-shaped scripts/quickstart.sh
#   scripts/burst_ttft.sh [ROUNDS] [ADDR]        (env HMOE: the client, default build/quickstart)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HMOE="${HMOE:-$ROOT/build/quickstart/tools/hmoe}"
ROUNDS="${1:-5}"
ADDR="${2:-127.0.0.1:50051}"
PROMPTS=("The quick brown fox"
  "Hello there, how are you doing today on this fine morning?"
  "Once upon a time in a land far away there lived a king who had three daughters and a dog"
  "Summarize:"
  "List the prime numbers below one hundred, separated by commas, and explain why each is prime"
  "a b c d e f g h i j k l m n o p q r s t u v w x y z")
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"
require_client burst_ttft "$HMOE"
OUT="$(mktemp -d "${TMPDIR:-/tmp}/hmoe-burst.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT
for round in $(seq 1 "$ROUNDS"); do
  for i in "${!PROMPTS[@]}"; do
    "$HMOE" generate --addr "$ADDR" --prompt "${PROMPTS[$i]}" --max-new-tokens 8 \
      >"$OUT/$i.out" 2>&1 &
  done
  wait
  for i in "${!PROMPTS[@]}"; do
    ttft_ms "burst_ttft: request $i" "$OUT/$i.out"
  done | sort -n | awk -v r="$round" '{t[NR]=$1; s+=$1} END {
    if (NR == 0) exit 1
    printf "round %d: ", r; for (i = 1; i <= NR; ++i) printf "%s ", t[i];
    printf "| mean %.1f max %s\n", s / NR, t[NR] }'
done

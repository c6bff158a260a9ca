#!/usr/bin/env bash
# Chaos soak (issue #16 acceptance 4, docs/soak.md): deploys the stack the way scripts/quickstart.sh
# does (`hmoe deploy` + supervisord: hmoe-weightd, one CPU prefill worker, the decode worker,
# hmoe-router) on the `tiny` demo model, CPU only, drives a bounded mixed load through it with
# `hmoe load` (short and long prompts, streams cancelled by the client, tight deadlines, bursts past
# capacity) while SIGKILLing a random worker every HMOE_SOAK_KILL_EVERY_S seconds (supervisord
# restarts it) and restarting weightd every HMOE_SOAK_WEIGHTD_EVERY_S seconds, then stops the
# stack and prints a table: requests by outcome, kills, recoveries, recovery time p50/p99, requests
# lost on live workers, weight reloads, leaked shm segments / sockets / processes / zombies, RSS and
# open sockets of every process at the start (after warm-up) and at the end. Exits 1 when a
# criterion of the acceptance fails (0 lost on live workers, 0 weight reloads, p99 recovery < 5 s,
# no leaks, RSS growth < 5 % after warm-up), 2 when it cannot run.
#
#   scripts/soak.sh MINUTES
#
# Environment:
#   HMOE_BUILD_ROOT            build trees (default <repo>/build; the soak uses <root>/cpu, the
#                              build of `scripts/test.sh cpu`, and builds the binaries it lacks)
#   HMOE_SOAK_DIR              model, supervisord.conf, logs, requests.tsv (default <root>/soak)
#   HMOE_SOAK_KILL_EVERY_S     default 10;  HMOE_SOAK_WEIGHTD_EVERY_S  default 60
#   HMOE_SOAK_CONCURRENCY      client threads of the steady load (default 4)
#   HMOE_SOAK_BURST_EVERY_S    default 30;  HMOE_SOAK_BURST_SIZE  default 100
#   HMOE_SOAK_WARMUP_S         load and faults (a burst every 30 s) before the start snapshot
#                              (default 180: the router's allocator reaches its plateau; docs/soak.md)
#   HMOE_SOAK_RSS_GATE=0       report RSS growth >= 5 % without failing (default 1: gated)
#   HMOE_SOAK_WEIGHTD_ARGS     extra hmoe-weightd flags (--remove-on-exit shows the soak failing:
#                              every SIGTERM restart then reloads the weights)
#   HMOE_SOAK_PREFIX_CACHE_MB  the decode worker's --prefix-cache-mb (default 16; -1: the whole pool)
#   HMOE_JOBS                  build jobs (default nproc)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MINUTES="${1:-}"
if [[ ! "$MINUTES" =~ ^[0-9]+([.][0-9]+)?$ ]]; then
  echo "usage: scripts/soak.sh MINUTES" >&2
  exit 2
fi
BUILD_ROOT="${HMOE_BUILD_ROOT:-$ROOT/build}"
BUILD="$BUILD_ROOT/cpu"
SOAK="${HMOE_SOAK_DIR:-$BUILD_ROOT/soak}"
start=$SECONDS
say() { echo "soak [$((SECONDS - start)) s]: $*"; }
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"

# --- the binaries (the cpu configuration of scripts/test.sh; a no-op after `test.sh cpu`)
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}" CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1
if [[ ! -f "$BUILD/build.ninja" ]]; then
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DHMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$BUILD" -j "${HMOE_JOBS:-$(nproc)}" --target hmoe-weightd hmoe-decode-worker \
  hmoe-prefill-worker hmoe-router hmoe hmoe-make-model >/dev/null
# A copy of the binaries: supervisord restarts killed workers from it, so a rebuild of the tree
# during a long soak does not change what runs.
BIN="$SOAK/bin"
mkdir -p "$BIN"
cp -f "$BUILD"/weightd/hmoe-weightd "$BUILD"/decode_worker/hmoe-decode-worker \
  "$BUILD"/prefill_worker/hmoe-prefill-worker "$BUILD"/router/hmoe-router "$BUILD"/tools/hmoe \
  "$BIN"/
HMOE="$BIN/hmoe"

# --- the tiny demo model and the deployment (a private instance, socket directory and port)
mkdir -p "$SOAK"
if [[ ! -f "$SOAK/tiny/config.json" ]]; then
  "$BUILD/tools/hmoe-make-model" --preset tiny --out "$SOAK/tiny" >/dev/null 2>&1
fi
INSTANCE="soak-$$"
RUN_DIR="/tmp/hmoe-soak-$(id -u)-$$"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
ADDR="127.0.0.1:$PORT"
DEPLOY="$SOAK/deploy"
rm -rf "$DEPLOY"
CONF="$DEPLOY/supervisord.conf"
# Long prompts (300-600 tokens) go to the prefill worker (SLP) next to decode: chunk threshold
# 256 of the tiny model's 1024-token context, CPU devices not treated as shared. The decode
# worker's prefix cache is on with a 16 MiB budget (HMOE_SOAK_PREFIX_CACHE_MB): it fills during
# the warm-up, so the RSS gate measures leaks, not a cache growing into the 1 GiB KV pool.
"$HMOE" deploy --model "$SOAK/tiny" --out "$DEPLOY" --run-dir "$RUN_DIR" --gpus 0 \
  --prefill-workers 1 --listen "$ADDR" --instance "$INSTANCE" --bin-dir "$BIN" \
  --router-args="--chunk-threshold=256 --cpu-devices-shared=false" \
  --decode-args="--prefix-cache-mb=${HMOE_SOAK_PREFIX_CACHE_MB:-16}" \
  --weightd-args="${HMOE_SOAK_WEIGHTD_ARGS:-}" >/dev/null
cleanup() {
  stop_supervisord "$CONF" "$RUN_DIR"
  # The weight store is kept by weightd on exit (so that a restart adopts it): remove it here.
  rm -f /dev/shm/hmoe."$INSTANCE".*
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT
say "starting the stack ($INSTANCE on $ADDR; logs in $DEPLOY/logs)"
supervisord -c "$CONF"
if ! wait_for_stack "$HMOE" "$ADDR" "$CONF" "$DEPLOY/logs" 'weightd|prefill-0|decode|router' \
  'PREFILL +LIVE'; then
  say "the stack did not come up"
  exit 2
fi
wait_for_stack "$HMOE" "$ADDR" "$CONF" "$DEPLOY/logs" || exit 2

say "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores;" \
  "load: $(uptime | sed 's/.*load average: //')"
set +e
python3 -B "$ROOT/scripts/lib/soak.py" --hmoe "$HMOE" --addr "$ADDR" --conf "$CONF" \
  --run-dir "$RUN_DIR" --log-dir "$DEPLOY/logs" --instance "$INSTANCE" --out "$SOAK" \
  --minutes "$MINUTES" --kill-every-s "${HMOE_SOAK_KILL_EVERY_S:-10}" \
  --weightd-every-s "${HMOE_SOAK_WEIGHTD_EVERY_S:-60}" \
  --concurrency "${HMOE_SOAK_CONCURRENCY:-4}" --burst-every-s "${HMOE_SOAK_BURST_EVERY_S:-30}" \
  --burst-size "${HMOE_SOAK_BURST_SIZE:-100}" --warmup-s "${HMOE_SOAK_WARMUP_S:-180}" \
  --rss-gate "${HMOE_SOAK_RSS_GATE:-1}"
rc=$?
set -e
say "load at the end: $(uptime | sed 's/.*load average: //'); requests in $SOAK/requests.tsv," \
  "kills in $SOAK/events.tsv"
exit "$rc"

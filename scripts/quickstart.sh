#!/usr/bin/env bash
# The README's first command: on a fresh clone, installs the dependencies, builds, writes the
# `small` demo checkpoint, starts the whole service under supervisord (hmoe-weightd, the prefill
# worker(s) when hmoe-prefill-worker is built, hmoe-decode-worker, hmoe-router; the CPU backend when
# the machine has no GPU), waits until it serves, sends a generation through the router's public
# gRPC API with the bundled client (`hmoe generate`), prints the streamed text with TTFT/TPOT, then
# one streamed chat completion through the OpenAI-compatible HTTP API (curl -N), and stops
# everything again.
#
# Environment:
#   HMOE_BUILD_ROOT      build trees (default <repo>/build; this script uses <root>/quickstart)
#   HMOE_MODEL_DIR       the demo checkpoint (default <repo>/out/small; written when missing), or
#                        a GGUF file (*.gguf: served as it is, docs/gguf.md)
#   HMOE_GGUF=1          the demo model as a Q4_K_M GGUF instead (default
#                        <repo>/out/small-gguf/model.gguf; written when missing)
#   HMOE_DEPLOY_DIR      supervisord.conf, logs (default <repo>/out/quickstart)
#   HMOE_PORT            the router's port on 127.0.0.1 (default 50051)
#   HMOE_HTTP_PORT       the router's OpenAI HTTP port on 127.0.0.1 (default 8000)
#   HMOE_PROMPT          the prompt (default "The quick brown fox")
#   HMOE_MAX_NEW_TOKENS  tokens to generate (default 32)
#   HMOE_KEEP_RUNNING=1  leave the service running (the script prints how to stop it)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HMOE_BUILD_ROOT:-$ROOT/build}/quickstart"
if [[ "${HMOE_GGUF:-0}" == 1 ]]; then
  MODEL="${HMOE_MODEL_DIR:-$ROOT/out/small-gguf/model.gguf}"
else
  MODEL="${HMOE_MODEL_DIR:-$ROOT/out/small}"
fi
DEPLOY="${HMOE_DEPLOY_DIR:-$ROOT/out/quickstart}"
PORT="${HMOE_PORT:-50051}"
HTTP_PORT="${HMOE_HTTP_PORT:-8000}"
PROMPT="${HMOE_PROMPT:-The quick brown fox}"
MAX_NEW="${HMOE_MAX_NEW_TOKENS:-32}"
start=$SECONDS
say() { echo "quickstart [$((SECONDS - start)) s]: $*"; }
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"

"$ROOT/scripts/setup-deps.sh"

# --- build (CUDA only when a GPU is present: the CPU backend otherwise)
GPUS=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L | grep -c '^GPU ')
fi
# A GGUF runs on the CPU backend only for now (docs/gguf.md "Serving a GGUF").
if [[ "$MODEL" == *.gguf ]]; then GPUS=0; fi
CUDA=OFF
[[ $GPUS -gt 0 ]] && CUDA=AUTO
say "building in $BUILD (GPUs: $GPUS, CUDA backend: $CUDA)"
if [[ -z "${CCACHE_DIR:-}" && -d "$HOME/.cache/ccache" ]]; then export CCACHE_DIR="$HOME/.cache/ccache"; fi
export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DHMOE_CUDA=$CUDA -DHMOE_BUILD_BENCHMARKS=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
TARGETS=(hmoe-weightd hmoe-decode-worker hmoe-router hmoe hmoe-make-model)
if ninja_has_target "$BUILD" hmoe-prefill-worker; then
  TARGETS+=(hmoe-prefill-worker)
fi
cmake --build "$BUILD" --target "${TARGETS[@]}" -j "$(nproc)"
HMOE="$BUILD/tools/hmoe"

# --- the demo checkpoint (random weights, a real tokenizer)
if [[ "$MODEL" == *.gguf ]]; then
  if [[ ! -f "$MODEL" && "$(basename "$MODEL")" == model.gguf ]]; then
    say "writing the small demo model as a Q4_K_M GGUF to $MODEL"
    "$BUILD/tools/hmoe-make-model" --preset small --out "$(dirname "$MODEL")" --format gguf \
      --quant q4_k_m
  fi
elif [[ ! -f "$MODEL/config.json" ]]; then
  say "writing the small demo checkpoint to $MODEL"
  mkdir -p "$(dirname "$MODEL")"
  "$BUILD/tools/hmoe-make-model" --preset small --out "$MODEL"
fi

# --- the service under supervisord
CONF="$DEPLOY/supervisord.conf"
RUN_DIR="$DEPLOY/run"
if [[ ${#RUN_DIR} -gt 80 ]]; then RUN_DIR="/tmp/hmoe-quickstart-$(id -u)"; fi  # unix socket paths
if [[ -f "$CONF" ]] && supervisorctl -c "$CONF" status >/dev/null 2>&1; then
  say "stopping the service a previous quickstart left running"
  stop_supervisord "$CONF" "$RUN_DIR"
fi
"$HMOE" deploy --model "$MODEL" --out "$DEPLOY" --run-dir "$RUN_DIR" --gpus "$GPUS" \
  --listen "127.0.0.1:$PORT" --http-listen "127.0.0.1:$HTTP_PORT" --instance quickstart --weightd-args=--remove-on-exit
supervisord -c "$CONF"
stop_service() {
  stop_supervisord "$CONF" "$RUN_DIR"
  echo "quickstart: service stopped"
}
if [[ "${HMOE_KEEP_RUNNING:-0}" != 1 ]]; then trap stop_service EXIT; fi

say "waiting for the router and a live decode worker"
# A program that cannot start (weightd, decode worker, router; a prefill worker is optional here:
# the demo prompt is short) ends the wait.
if ! wait_for_stack "$HMOE" "127.0.0.1:$PORT" "$CONF" "$DEPLOY/logs"; then
  say "the service did not come up (logs above, all logs in $DEPLOY/logs)"
  exit 1
fi
"$HMOE" health --addr "127.0.0.1:$PORT"
"$HMOE" status --addr "127.0.0.1:$PORT"

say "generating $MAX_NEW tokens through the router for: \"$PROMPT\""
echo "-----"
"$HMOE" generate --addr "127.0.0.1:$PORT" --prompt "$PROMPT" --max-new-tokens "$MAX_NEW" \
  --ignore-eos
echo "-----"
say "the same service through the OpenAI-compatible HTTP API (http://127.0.0.1:$HTTP_PORT/v1):"
CHAT_BODY=$(python3 -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "messages": [{"role": "user", "content": sys.argv[2]}], "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True}))' "$(basename "$MODEL")" "$PROMPT")
echo "curl -N http://127.0.0.1:$HTTP_PORT/v1/chat/completions -H 'Content-Type: application/json' -d '$CHAT_BODY'"
echo "-----"
curl -sS -N --fail-with-body "http://127.0.0.1:$HTTP_PORT/v1/chat/completions" \
  -H 'Content-Type: application/json' -d "$CHAT_BODY"
echo "-----"
say "done (the demo model has random weights: the text is gibberish by design; greedy tokens are"
echo "            deterministic). Logs: $DEPLOY/logs/"
if [[ "${HMOE_KEEP_RUNNING:-0}" == 1 ]]; then
  echo "The service keeps running on 127.0.0.1:$PORT. Try:"
  echo "  $HMOE generate --addr 127.0.0.1:$PORT --prompt \"Hello\" --max-new-tokens 16"
  echo "  curl -N http://127.0.0.1:$HTTP_PORT/v1/chat/completions -H 'Content-Type: application/json' \\"
  echo "    -d '{\"model\":\"$(basename "$MODEL")\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"stream\":true}'"
  echo "  supervisorctl -c $CONF status"
  echo "Stop it with:"
  echo "  supervisorctl -c $CONF shutdown"
else
  echo "Stopping the service (run with HMOE_KEEP_RUNNING=1 to keep it; it is then stopped with"
  echo "  supervisorctl -c $CONF shutdown)"
fi

#!/usr/bin/env bash
# The README's first command: installs dependencies, builds, creates the `small` demo checkpoint and
# shows a real generation from it.
#
# Interim form (issue #6 turns this into the whole service under supervisord): the router and the
# worker processes are not wired into a deployment yet, so this runs the reference forward pass
# (hmoe-generate) on the demo model. Environment: HMOE_BUILD_ROOT (default <repo>/build),
# HMOE_MODEL_DIR (default <repo>/out/small), HMOE_PROMPT, HMOE_MAX_NEW_TOKENS.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HMOE_BUILD_ROOT:-$ROOT/build}/cpu"
MODEL="${HMOE_MODEL_DIR:-$ROOT/out/small}"
PROMPT="${HMOE_PROMPT:-The quick brown fox}"
MAX_NEW="${HMOE_MAX_NEW_TOKENS:-24}"
start=$SECONDS

"$ROOT/scripts/setup-deps.sh"
echo "quickstart: building (CPU backend) in $BUILD"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DHMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD" --target hmoe-make-model hmoe-generate -j "$(nproc)"

if [[ ! -f "$MODEL/config.json" ]]; then
  echo "quickstart: writing the small demo checkpoint to $MODEL"
  mkdir -p "$(dirname "$MODEL")"
  "$BUILD/tools/hmoe-make-model" --preset small --out "$MODEL"
fi

echo "quickstart: generating $MAX_NEW tokens for: \"$PROMPT\""
"$BUILD/tools/hmoe-generate" --model "$MODEL" --prompt "$PROMPT" --max-new-tokens "$MAX_NEW"
echo "quickstart: done in $((SECONDS - start)) s (the demo model has random weights: the text is"
echo "            gibberish by design; the token ids are deterministic)"

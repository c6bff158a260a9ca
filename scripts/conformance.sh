#!/usr/bin/env bash
# Checks that our FP32 reference forward pass (common/engine/reference, via hmoe-generate) gives the
# same logits as Hugging Face transformers' DeepSeek-V3 implementation (DeepseekV3ForCausalLM on
# the CPU, float32) on the tiny checkpoint. Optional: not part of scripts/test.sh (it downloads
# torch, transformers and safetensors from PyPI). See docs/conformance.md.
#
#   scripts/conformance.sh            # compare our reference with transformers on tiny
#   scripts/conformance.sh --golden   # rewrite tests/data/golden/*.json.gz (pinned versions)
#
# --golden: builds hmoe-make-model, creates the venv with the pinned packages below, and runs
# scripts/conformance_golden.py over tests/data/golden/configs.json: each configuration's
# checkpoint made with --config-override, HF's float32 logits written to tests/data/golden (what
# hmoe_golden_logits_test compares the reference and the engine with; docs/conformance.md).
#
# Steps: build hmoe-make-model and hmoe-generate (reusing build/cpu when it exists, else a CPU
# build in build/conformance-build); create or reuse a virtual environment with torch,
# transformers, safetensors and numpy; write the tiny checkpoint (seed 0) to a temporary
# directory; run hmoe-generate on a deterministic 128-token prompt with --dump-logits (absorbed
# and naive MLA) and 16 greedy tokens; then scripts/conformance.py dequantizes the FP8 checkpoint
# itself, loads it into transformers' model class and compares every prompt position's logits,
# the greedy continuation and the decode-step logits. Exit code 0 = conformant.
#
# Environment:
#   HMOE_CONFORMANCE_VENV     virtual environment (default <repo>/build/venv-conformance); reused
#                             when it already imports the packages
#   HMOE_CONFORMANCE_BUILD    an existing CMake build directory to use instead
#   HMOE_PYTHON               interpreter that creates the venv (default: python3)
#   HMOE_CONFORMANCE_PACKAGES pip requirements (default: "torch transformers>=4.51 safetensors
#                             numpy"). PyPI's Linux torch wheel pulls in CUDA libraries (several
#                             GB); pip's own settings (e.g. an extra index) are honoured.
#   HMOE_CONFORMANCE_SEED     weight seed of the tiny checkpoint (default 0)
#   HMOE_CONFORMANCE_DTYPE    fp8 (default, like the real checkpoint) or bf16
#   HMOE_CONFORMANCE_KEEP=1   keep the temporary directory (checkpoint, logits dumps)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HMOE_CONFORMANCE_VENV:-$ROOT/build/venv-conformance}"
PYTHON="${HMOE_PYTHON:-python3}"
GOLDEN=0
if [[ "${1:-}" == "--golden" ]]; then
  GOLDEN=1
elif [[ $# -gt 0 ]]; then
  echo "usage: scripts/conformance.sh [--golden]" >&2
  exit 2
fi
# The golden files record the versions that made them; --golden installs exactly these.
GOLDEN_PACKAGES="torch==2.15.0 transformers==5.23.0 safetensors==0.8.0 numpy==2.4.6"
if [[ $GOLDEN == 1 ]]; then
  DEFAULT_PACKAGES="$GOLDEN_PACKAGES"
else
  DEFAULT_PACKAGES="torch transformers>=4.51 safetensors numpy"
fi
read -r -a PACKAGES <<<"${HMOE_CONFORMANCE_PACKAGES:-$DEFAULT_PACKAGES}"
SEED="${HMOE_CONFORMANCE_SEED:-0}"
DTYPE="${HMOE_CONFORMANCE_DTYPE:-fp8}"
PROMPT_TOKENS=128
NEW_TOKENS=16

log() { printf '==== [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() {
  printf 'conformance.sh: %s\n' "$*" >&2
  exit 2
}

# ---- build the two tools
if [[ -n "${HMOE_CONFORMANCE_BUILD:-}" ]]; then
  BUILD="$HMOE_CONFORMANCE_BUILD"
  [[ -f "$BUILD/build.ninja" ]] ||
    die "HMOE_CONFORMANCE_BUILD=$BUILD is not a Ninja build directory"
elif [[ -f "$ROOT/build/cpu/build.ninja" ]]; then
  BUILD="$ROOT/build/cpu"
else
  BUILD="$ROOT/build/conformance-build"
  if [[ ! -f "$BUILD/build.ninja" ]]; then
    log "configure $BUILD"
    mkdir -p "$BUILD"
    cmake -S "$ROOT" -B "$BUILD" -G Ninja -DHMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      >"$BUILD.configure.log" 2>&1 || {
      cat "$BUILD.configure.log"
      die "cmake configure failed"
    }
  fi
fi
log "build hmoe-make-model hmoe-generate in $BUILD"
cmake --build "$BUILD" --target hmoe-make-model hmoe-generate
MAKE_MODEL="$BUILD/tools/hmoe-make-model"
GENERATE="$BUILD/tools/hmoe-generate"

# ---- the Python environment
have_packages() {
  [[ -x "$VENV/bin/python" ]] &&
    "$VENV/bin/python" -c 'import numpy, safetensors, torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM' >/dev/null 2>&1
}
have_pinned() {
  [[ $GOLDEN == 0 ]] && return 0
  "$VENV/bin/python" - "${PACKAGES[@]}" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    if want and version(name).split("+")[0] != want:
        sys.exit(1)
PY
}
if have_packages && have_pinned; then
  log "reusing the virtual environment $VENV"
else
  if [[ ! -x "$VENV/bin/python" ]]; then
    log "create the virtual environment $VENV"
    "$PYTHON" -m venv "$VENV" ||
      die "cannot create a venv with $PYTHON (Debian: apt-get install python3-venv)"
  fi
  log "pip install ${PACKAGES[*]} (downloads from PyPI)"
  "$VENV/bin/python" -m pip install --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install "${PACKAGES[@]}"
  have_packages ||
    die "$VENV still cannot import torch, transformers (DeepseekV3ForCausalLM) or safetensors"
fi

# ---- --golden: HF's logits for every configuration of tests/data/golden/configs.json
if [[ $GOLDEN == 1 ]]; then
  have_pinned || die "$VENV does not have the pinned $GOLDEN_PACKAGES"
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/hmoe-golden.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
  log "golden logits (${GOLDEN_PACKAGES}) -> tests/data/golden"
  "$VENV/bin/python" "$ROOT/scripts/conformance_golden.py" --make-model "$MAKE_MODEL" \
    --configs "$ROOT/tests/data/golden/configs.json" --out-dir "$ROOT/tests/data/golden" \
    --work "$WORK"
  exit 0
fi

# ---- checkpoint and our logits
WORK="$(mktemp -d "${TMPDIR:-/tmp}/hmoe-conformance.XXXXXX")"
if [[ "${HMOE_CONFORMANCE_KEEP:-0}" == 1 ]]; then
  log "keeping $WORK"
else
  trap 'rm -rf "$WORK"' EXIT
fi
log "write the tiny checkpoint ($DTYPE, seed $SEED) to $WORK/tiny"
"$MAKE_MODEL" --preset tiny --seed "$SEED" --dtype "$DTYPE" --out "$WORK/tiny" \
  2>"$WORK/make_model.log" || {
  cat "$WORK/make_model.log"
  die "hmoe-make-model failed"
}

# Deterministic prompt: BOS (id 0 in the tiny tokenizer) then ids in [2, 1002) from a 31-bit LCG
# (every one below the tiny vocab of 1024; 0/1 = BOS/EOS are avoided after the first).
ids=(0)
x=12345
while ((${#ids[@]} < PROMPT_TOKENS)); do
  x=$(((x * 1103515245 + 12345) % 2147483648))
  ids+=($((2 + (x >> 8) % 1000)))
done
PROMPT_IDS="$(
  IFS=,
  echo "${ids[*]}"
)"

run_generate() {  # form, then extra flags
  local form="$1"
  shift
  "$GENERATE" --model "$WORK/tiny" --prompt-ids "$PROMPT_IDS" --max-new-tokens "$NEW_TOKENS" \
    --mla "$form" --dump-logits "$WORK/logits-$form.bin" "$@" >"$WORK/out-$form.txt" \
    2>"$WORK/err-$form.txt" || {
    cat "$WORK/err-$form.txt"
    die "hmoe-generate --mla $form failed"
  }
  cat "$WORK/err-$form.txt"
}
log "hmoe-generate: $PROMPT_TOKENS prompt + $NEW_TOKENS greedy tokens, absorbed and naive MLA"
run_generate absorbed --print-logits
run_generate naive
CONT_ABSORBED="$(head -n 1 "$WORK/out-absorbed.txt")"
CONT_NAIVE="$(head -n 1 "$WORK/out-naive.txt")"
if [[ "$CONT_ABSORBED" != "$CONT_NAIVE" ]]; then
  echo "conformance: absorbed continuation $CONT_ABSORBED != naive $CONT_NAIVE" >&2
  exit 1
fi

# ---- compare with transformers
log "compare with Hugging Face transformers"
"$VENV/bin/python" "$ROOT/scripts/conformance.py" --model "$WORK/tiny" \
  --prompt-ids "$PROMPT_IDS" \
  --ours-logits "absorbed=$WORK/logits-absorbed.bin" --ours-logits "naive=$WORK/logits-naive.bin" \
  --ours-continuation "$CONT_ABSORBED" --ours-step-logits "$WORK/out-absorbed.txt"

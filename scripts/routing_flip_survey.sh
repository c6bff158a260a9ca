#!/usr/bin/env bash
# Issue 19 item 6: teacher-forced agreement of the engine with the FP32 reference over long greedy
# generations, every routing flip proven a near-tie (docs/conformance.md "Routing flips: the
# score-gap rule"). Not part of scripts/test.sh (CI runs the test's short default); the full
# survey takes about 5 minutes per `small` seed on 2 cores, nearly all in the FP32 reference.
#
#   scripts/routing_flip_survey.sh [PRESETS [SEEDS [TOKENS]]]   # defaults: tiny,small 0,1,2 1008
# Uses build/cpu (configured by scripts/test.sh cpu) or HMOE_BUILD_DIR.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${HMOE_BUILD_DIR:-$ROOT/build/cpu}"
if [[ ! -f "$BUILD/build.ninja" && ! -f "$BUILD/Makefile" ]]; then
  echo "routing_flip_survey.sh: no build in $BUILD (run scripts/test.sh cpu first)" >&2
  exit 2
fi
cmake --build "$BUILD" -j "${HMOE_JOBS:-2}" --target hmoe_routing_flip_survey_test
HMOE_FLIP_SURVEY_PRESETS="${1:-tiny,small}" HMOE_FLIP_SURVEY_SEEDS="${2:-0,1,2}" \
  HMOE_FLIP_SURVEY_TOKENS="${3:-1008}" \
  "$BUILD/tests/decode_worker/hmoe_routing_flip_survey_test"

#!/usr/bin/env bash
# Proves that scripts/check_layering.sh fails on a planted upward include, names the file, the line
# and the rule, and passes on the same tree without it. Runs on a temporary copy of the real rules
# (docs/architecture.md) with a few small sources. Usage: check_layering_test.sh REPO_ROOT
set -euo pipefail

REPO="$1"
CHECK="$REPO/scripts/check_layering.sh"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

mkdir -p "$TMP/docs" "$TMP/common/base" "$TMP/common/device" "$TMP/common/engine/reference" \
  "$TMP/common/kernels"
cp "$REPO/docs/architecture.md" "$TMP/docs/"
printf '#pragma once\n' >"$TMP/common/base/logging.h"
printf '#pragma once\n' >"$TMP/common/kernels/shared_math.h"
printf '#pragma once\n' >"$TMP/common/kernels/op_params.h"
printf '#pragma once\n#include "common/base/logging.h"\n' >"$TMP/common/device/device.h"
printf '#pragma once\n#include "common/kernels/op_params.h"\n#include <vector>\n' \
  >"$TMP/common/engine/reference/reference_ops.h"

# 1. A clean tree passes.
"$CHECK" "$TMP" >"$TMP/out" 2>&1 || fail "clean tree rejected: $(cat "$TMP/out")"

# 2. common/base including common/device (an include that points up) fails, naming file:line and
#    the rule.
printf '#pragma once\n\n#include "common/device/device.h"\n' >"$TMP/common/base/planted.h"
if "$CHECK" "$TMP" >"$TMP/out" 2>&1; then
  fail "upward include common/base -> common/device accepted"
fi
grep -q 'common/base/planted.h:3: includes "common/device/device.h" (common/device); rule "common/base:' \
  "$TMP/out" || fail "message does not name file, line and rule: $(cat "$TMP/out")"
rm "$TMP/common/base/planted.h"

# 3. The oracle may not include production code beside its allowed header.
printf '#pragma once\n#include "common/kernels/shared_math.h"\n' \
  >"$TMP/common/engine/reference/planted.h"
if "$CHECK" "$TMP" >"$TMP/out" 2>&1; then
  fail "reference -> common/kernels/shared_math.h accepted"
fi
grep -q 'common/engine/reference/planted.h:2: includes "common/kernels/shared_math.h"' "$TMP/out" ||
  fail "reference violation not reported: $(cat "$TMP/out")"
rm "$TMP/common/engine/reference/planted.h"

# 4. A source in a folder without a rule fails.
mkdir -p "$TMP/newfolder"
printf '#pragma once\n' >"$TMP/newfolder/x.h"
if "$CHECK" "$TMP" >"$TMP/out" 2>&1; then fail "folder without a rule accepted"; fi
grep -q 'newfolder/x.h: no layering rule' "$TMP/out" || fail "missing rule not reported"
rm -r "$TMP/newfolder"

"$CHECK" "$TMP" >/dev/null 2>&1 || fail "tree not clean again"
echo "check_layering_test: ok"

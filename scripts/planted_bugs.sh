#!/usr/bin/env bash
# Shows that the golden-logits test fails for each planted bug (docs/conformance.md "Planted
# bugs"): copies HEAD into a temporary tree (git archive; the working tree is never patched),
# configures a CPU build there, and per bug applies scripts/planted_bugs.py's patch, builds
# hmoe_golden_logits_test, runs it, and restores the tree. Prints one PASS/FAIL line per bug with
# the test's summary lines; "none" (no bug) must pass, every other bug must fail.
#
#   scripts/planted_bugs.sh [BUG ...]     (default: all of them)
#
# Environment: HMOE_PLANTED_TREE (default: a new mktemp directory, removed at the end),
# HMOE_JOBS (default 2).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUGS=("$@")
if [[ ${#BUGS[@]} -eq 0 ]]; then
  BUGS=(none router-bias router-bias-ref block-scale block-scale-ref expert-scale rope-1000
    rope-1000-ref routed-scaling routed-scaling-ref mscale mscale-ref)
fi
TREE="${HMOE_PLANTED_TREE:-}"
if [[ -z "$TREE" ]]; then
  TREE="$(mktemp -d "${TMPDIR:-/tmp}/hmoe-planted.XXXXXX")"
  trap 'rm -rf "$TREE"' EXIT
fi
mkdir -p "$TREE/src"
(cd "$ROOT" && git archive HEAD) | tar -x -C "$TREE/src"
mapfile -t FILES < <(python3 "$ROOT/scripts/planted_bugs.py" --files)
mkdir -p "$TREE/pristine"
for f in "${FILES[@]}"; do
  mkdir -p "$TREE/pristine/$(dirname "$f")"
  cp "$TREE/src/$f" "$TREE/pristine/$f"
done
# Restores the patchable files (fresh mtimes, so ninja rebuilds what a patch had touched).
restore() {
  for f in "${FILES[@]}"; do cp "$TREE/pristine/$f" "$TREE/src/$f"; done
}
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}" CCACHE_BASEDIR="$TREE/src" CCACHE_NOHASHDIR=1
cmake -S "$TREE/src" -B "$TREE/src/build" -G Ninja -DHMOE_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$TREE/configure.log" 2>&1 || {
  cat "$TREE/configure.log"
  exit 2
}
status=0
for bug in "${BUGS[@]}"; do
  restore
  python3 "$ROOT/scripts/planted_bugs.py" "$TREE/src" "$bug"
  cmake --build "$TREE/src/build" -j "${HMOE_JOBS:-2}" --target hmoe_golden_logits_test \
    >"$TREE/build-$bug.log" 2>&1 || {
    tail -20 "$TREE/build-$bug.log"
    echo "planted $bug: BUILD FAILED"
    status=1
    continue
  }
  if "$TREE/src/build/tests/engine/hmoe_golden_logits_test" >"$TREE/test-$bug.log" 2>&1; then
    result=PASS
  else
    result=FAIL
  fi
  grep -E '^golden |FAILED  \] Golden' "$TREE/test-$bug.log" | sed 's/^/  /' || true
  expected=FAIL
  [[ "$bug" == none ]] && expected=PASS
  echo "planted $bug: golden test $result (expected $expected)"
  [[ "$result" == "$expected" ]] || status=1
done
restore
exit $status

#!/usr/bin/env bash
# Checks of scripts/ (ctest hmoe_scripts_test): usage: scripts_test.sh REPO_ROOT BUILD_DIR
#  1. No script that sets pipefail pipes into a reader that stops early (grep -q, grep -m, head):
#     the producer then dies of SIGPIPE and pipefail turns a match into a failure. This is how
#     quickstart.sh never found hmoe-prefill-worker in `ninja -t targets all` (issue 16, finding 6).
#  2. scripts/lib/common.sh's ninja_has_target, run under pipefail against this very build tree
#     (a real, long `ninja -t targets all`), finds the targets quickstart.sh asks about and no
#     target that does not exist; quickstart.sh uses it for the prefill worker.
set -euo pipefail
ROOT="$1"
BUILD="$2"
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# --- 1. no early-exit reader at the end of a pipe in a pipefail script
early_exit='\|[[:space:]]*(grep([[:space:]]+-[^[:space:]]*)*[[:space:]]+-[A-Za-z]*[qm][A-Za-z0-9]*|grep[^|]*--(quiet|silent|max-count)|head)([[:space:]]|$)'
checked=0
while IFS= read -r -d '' script; do
  if ! grep -q 'pipefail' "$script"; then continue; fi
  checked=$((checked + 1))
  hits=$(grep -nE -- "$early_exit" "$script" | grep -vE '^[0-9]+:[[:space:]]*#' || true)
  if [[ -n "$hits" ]]; then
    fail "${script#"$ROOT"/} pipes into a reader that exits early under pipefail:"
    echo "$hits"
  fi
done < <(find "$ROOT/scripts" -name '*.sh' -print0)
[[ $checked -gt 0 ]] || fail "no pipefail script found under $ROOT/scripts"
# The pattern itself must catch the bug it is for (a check that cannot fail is no check).
for bad in "ninja -t targets all | grep -q '^x:'" "a | grep -E b | grep -qE 'c'" "x | head -3" \
  "y | grep -m1 z"; do
  grep -qE -- "$early_exit" <<<"$bad" || fail "the lint misses: $bad"
done
for good in "x | grep -c y" "x | grep -v y" "grep -q y file" "x | grep -o 'q' | awk '{print}'"; do
  if grep -qE -- "$early_exit" <<<"$good"; then fail "the lint flags the harmless: $good"; fi
done

# --- 2. target detection under pipefail against a real Ninja tree
if [[ -f "$BUILD/build.ninja" ]]; then
  # shellcheck source=../../scripts/lib/common.sh
  source "$ROOT/scripts/lib/common.sh"
  for target in hmoe-prefill-worker hmoe-router hmoe-decode-worker; do
    ninja_has_target "$BUILD" "$target" || fail "ninja_has_target misses $target in $BUILD"
  done
  for target in hmoe-no-such-target hmoe-prefill hmoe-prefill-worker-; do
    if ninja_has_target "$BUILD" "$target"; then fail "ninja_has_target finds $target"; fi
  done
  if ninja_has_target /nonexistent-dir hmoe-router; then fail "a missing build dir has targets"; fi
  output_matches 'DECODE +LIVE' printf 'x\nDECODE   LIVE\n' || fail "output_matches misses a line"
  if output_matches 'LIVE' false; then fail "output_matches matches a failed command"; fi
else
  echo "no build.ninja in $BUILD (not a Ninja build): target detection not checked"
fi
grep -q 'ninja_has_target "$BUILD" hmoe-prefill-worker' "$ROOT/scripts/quickstart.sh" ||
  fail "quickstart.sh does not detect hmoe-prefill-worker with ninja_has_target"

if [[ $failures -gt 0 ]]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "scripts OK ($checked pipefail scripts checked)"

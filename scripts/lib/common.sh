# Shell helpers shared by the scripts (sourced, not run). Every script here runs under
# `set -euo pipefail`, where `producer | grep -q PATTERN` is a trap: grep -q exits at its first
# match, the producer's next write gets SIGPIPE, the pipeline's status becomes 141 and the test
# reads as "no match" exactly when the pattern was found (reliably so for a long output such as
# `ninja -t targets all`). These helpers capture the output first and match it without a pipe;
# tests/scripts/scripts_test.sh rejects the pattern in any script that sets pipefail.

# ninja_has_target BUILD_DIR TARGET: true when the Ninja build in BUILD_DIR defines TARGET.
ninja_has_target() {
  local targets
  targets=$(ninja -C "$1" -t targets all 2>/dev/null) || return 1
  [[ $'\n'"$targets" == *$'\n'"$2:"* ]]
}

# output_matches ERE COMMAND [ARGS...]: true when COMMAND's stdout has a line matching ERE
# (COMMAND's stderr is discarded and its exit status ignored: a failed probe matches nothing).
output_matches() {
  local pattern="$1" out
  shift
  out=$("$@" 2>/dev/null) || true
  grep -qE -- "$pattern" <<<"$out"
}

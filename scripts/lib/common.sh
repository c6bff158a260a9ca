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

# require_client NAME HMOE: exits 2 with a message naming NAME when HMOE is not an executable.
require_client() {
  if [[ ! -x "$2" ]]; then
    echo "$1: no client at $2 (run scripts/quickstart.sh or scripts/test.sh cpu, or set HMOE)" >&2
    exit 2
  fi
}

# ttft_ms NAME FILE: the TTFT in ms that `hmoe generate` printed to FILE; exits 1 with the output
# when the request failed.
ttft_ms() {
  local t
  t=$(grep -o 'TTFT [0-9.]* ms' "$2" | awk '{print $2}' || true)
  if [[ -z "$t" ]]; then
    echo "$1: request failed:" >&2
    cat "$2" >&2
    exit 1
  fi
  echo "$t"
}

# stop_supervisord CONF RUN_DIR: shuts down the supervisord of CONF (SIGTERM to every program;
# each drains and exits) and waits for it (RUN_DIR/supervisord.pid) to exit, up to 60 s.
stop_supervisord() {
  local pid
  pid=$(cat "$2/supervisord.pid" 2>/dev/null || true)
  supervisorctl -c "$1" shutdown >/dev/null 2>&1 || true
  for _ in $(seq 1 300); do
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
}

# wait_for_stack HMOE ADDR CONF LOG_DIR [PROGRAMS_ERE] [NEED_ERE]: waits (up to 5 min) until
# `hmoe status` of the router at ADDR has a line matching NEED_ERE (default 'DECODE +LIVE': a live
# decode worker). Returns 1, printing supervisorctl status and the tails of the programs' logs,
# on time-out or as soon as a program matching PROGRAMS_ERE (default weightd|decode|router) is
# FATAL or in BACKOFF.
wait_for_stack() {
  local hmoe="$1" addr="$2" conf="$3" logs="$4" programs="${5:-weightd|decode|router}"
  local need="${6:-DECODE +LIVE}"
  for _ in $(seq 1 600); do
    if output_matches "$need" "$hmoe" status --addr "$addr" --timeout-s 2; then
      return 0
    fi
    if output_matches "^($programs) .*(FATAL|BACKOFF)" supervisorctl -c "$conf" status; then
      break
    fi
    sleep 0.5
  done
  supervisorctl -c "$conf" status || true
  local p
  for p in ${programs//|/ }; do
    echo "--- $logs/$p.log"
    tail -n 20 "$logs/$p.log" 2>/dev/null || true
  done
  return 1
}

# start_stack HMOE BUILD MODEL DIR PORT PREFILL_WORKERS INSTANCE [DECODE_ARGS] [PREFILL_ARGS]
#             [ROUTER_ARGS]:
# writes a node's configuration with `hmoe deploy` into DIR (sockets in DIR/run, no HTTP API,
# weightd removes its shared memory on exit, the decode worker unpinned), starts supervisord and
# waits until the router on 127.0.0.1:PORT lists a live decode worker and, with PREFILL_WORKERS >
# 0, a live prefill worker. Returns 1 (with the programs' logs) when the stack does not come up.
# The caller stops it with `stop_supervisord DIR/supervisord.conf DIR/run` (set the trap first).
start_stack() {
  local hmoe="$1" build="$2" model="$3" dir="$4" port="$5" prefill="$6" instance="$7"
  local decode_args="${8:-}" prefill_args="${9:-}" router_args="${10:-}"
  local conf="$dir/supervisord.conf"
  "$hmoe" deploy --model "$model" --out "$dir" --run-dir "$dir/run" \
    --instance "$instance" --listen "127.0.0.1:$port" --http-listen= --prefill-workers "$prefill" \
    --bin-dir "$build" --weightd-args="--remove-on-exit" \
    --decode-args="--pin-threads=false $decode_args" --prefill-args="$prefill_args" \
    --router-args="$router_args" >/dev/null ||
    return 1
  supervisord -c "$conf" || return 1
  if [[ "$prefill" -gt 0 ]]; then
    wait_for_stack "$hmoe" "127.0.0.1:$port" "$conf" "$dir/logs" 'weightd|decode|router' \
      'PREFILL +LIVE' || return 1
  fi
  # The prefill worker registers before the decode worker may have: wait for both.
  wait_for_stack "$hmoe" "127.0.0.1:$port" "$conf" "$dir/logs" 'weightd|decode|router'
}

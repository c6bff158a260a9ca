#!/bin/bash
# DSLP through the real processes (docs/PERFORMANCE.md "DSLP through the workers and the
# router"): hmoe-weightd + decode worker + 2 CPU prefill workers (1 thread each, unpinned) +
# router on the `small` checkpoint; TTFT of a 1024-token prompt with --hint slp (one prefill
# worker) and --hint dslp (both), alternating, and the prefill workers' per-request log lines.
#
#   scripts/dslp_stack_bench.sh [small_ep|standard] [ROUNDS]     (env BUILD=build/cpu)
set -u
cd "$(dirname "$0")/.."
B=$(realpath "${BUILD:-build/cpu}")
M=${MODEL:-/tmp/hmoe-dslp-bench-small}
EP=${1:-small_ep}
ROUNDS=${2:-3}
R=$(mktemp -d /tmp/dslpperf.XXXX)
chmod 700 $R
INST=dslpperf$$
[ -f $M/config.json ] || $B/tools/hmoe-make-model --preset small --out $M >/dev/null
pids=()
HMOE_RUNTIME_DIR=$R $B/weightd/hmoe-weightd --model $M --instance $INST --socket $R/weightd.sock \
  --hugepages off --numa off --remove-on-exit 2>$R/weightd.log & pids+=($!)
for i in $(seq 1 100); do grep -q "SERVING instance" $R/weightd.log && break; sleep 0.1; done
$B/router/hmoe-router --listen=127.0.0.1:0 --model=$M --registry-socket=$R/router.sock \
  --port-file=$R/port --chunk-threshold=32 --dslp-ep-mode=$EP 2>$R/router.log & pids+=($!)
$B/decode_worker/hmoe-decode-worker --weightd-instance $INST --socket $R/decode.sock \
  --router unix:$R/router.sock --worker-id decode-0 --threads 1 --pin-threads=false \
  --kv-blocks 256 --kv-block-tokens 16 2>$R/decode.log & pids+=($!)
for i in 0 1; do
  $B/prefill_worker/hmoe-prefill-worker --weightd-instance $INST --socket $R/prefill-$i.sock \
    --device cpu --router unix:$R/router.sock --worker-id prefill-$i --threads 1 \
    --pin-threads=false 2>$R/prefill-$i.log & pids+=($!)
done
for i in $(seq 1 100); do [ -s $R/port ] && break; sleep 0.1; done
PORT=$(cat $R/port)
sleep 2
IDS=$(python3 -c "print(','.join(str(2 + (7 * 131 + i * 37) % 1000) for i in range(1024)))")
for round in $(seq 1 $ROUNDS); do
  for hint in slp dslp; do
    echo "== round $round hint $hint ($EP) load $(cut -d' ' -f1 /proc/loadavg)"
    $B/tools/hmoe generate --addr 127.0.0.1:$PORT --prompt-ids $IDS --max-new-tokens 4 \
      --ignore-eos --hint $hint 2>&1 | grep -i "ttft\|path\|error" | head -3
  done
done
grep -h "prefilled" $R/prefill-*.log | sed 's/^.*prefill_scheduler.cc:[0-9]*\] //' | cut -c1-260
kill -TERM "${pids[@]}" 2>/dev/null
wait
rm -rf $R

#!/usr/bin/env bash
# Figures for docs/PERFORMANCE.md "weightd (issue #3)": load throughput against `cp` into /dev/shm,
# 2 MiB hugepages (Shared_Hugetlb), proportional set size of weightd + 3 workers, attach time.
#
#   tests/weightd/measure_weightd.sh BUILD_DIR MODEL_DIR [MORE_MODEL_DIRS...]
#
# The first model is used for every measurement; attach time is reported for all of them. Needs
# root for the hugepage part (it reserves 2 MiB pages and restores /proc/sys/vm/nr_hugepages).
# Leaves nothing behind: every weightd runs with --remove-on-exit under a private instance name.
set -euo pipefail

BUILD=${1:?usage: $0 BUILD_DIR MODEL_DIR [MODEL_DIR...]}
shift
MODEL=${1:?usage: $0 BUILD_DIR MODEL_DIR [MODEL_DIR...]}
WEIGHTD=$BUILD/weightd/hmoe-weightd
INSPECT=$BUILD/tools/hmoe-weightd-inspect
PROBE=$BUILD/tests/weightd/hmoe_weightd_attach_probe
export HMOE_RUNTIME_DIR=$(mktemp -d /tmp/hmoe-measure.XXXXXX)
WORK=$(mktemp -d /tmp/hmoe-measure-work.XXXXXX)
INSTANCE=measure-$$
PIDS=()
HUGE_BEFORE=$(cat /proc/sys/vm/nr_hugepages)
RUNS=${RUNS:-7}

cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -w /proc/sys/vm/nr_hugepages ] && echo "$HUGE_BEFORE" > /proc/sys/vm/nr_hugepages || true
  rm -rf "$WORK" "$HMOE_RUNTIME_DIR" /dev/shm/hmoe-measure-cp.$$
}
trap cleanup EXIT

# start_weightd MODEL [FLAGS...]: starts weightd in the background, waits until ready.
start_weightd() {
  local model=$1
  shift
  "$WEIGHTD" --model "$model" --instance "$INSTANCE" --remove-on-exit "$@" 2> "$WORK/weightd.log" &
  WEIGHTD_PID=$!
  PIDS+=("$WEIGHTD_PID")
  "$INSPECT" --instance "$INSTANCE" --wait-ready-seconds 900 > /dev/null
}
stop_weightd() {
  kill -TERM "$WEIGHTD_PID"
  wait "$WEIGHTD_PID"
}
status_field() {  # status_field NAME -> value from `inspect --status`
  local out
  out=$("$INSPECT" --instance "$INSTANCE" --status)
  echo "$out" | sed -n "1s/.*$1 \([0-9.]*\) s.*/\1/p"
}
rollup() {  # rollup PID FIELD -> kB
  awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/smaps_rollup"
}
shm_pss_kb() {  # Pss of the SysV shm mappings of PID
  awk '/^[0-9a-f]+-[0-9a-f]+ / { shm = ($0 ~ /SYSV/ || $0 ~ /\/dev\/shm\/hmoe\./) } shm && $1 == "Pss:" { s += $2 } END { print s + 0 }' "/proc/$1/smaps"
}

echo "model: $MODEL ($(du -sb "$MODEL" | cut -f1) bytes on disk)"
echo "machine: $(nproc) vCPU, $(awk '/MemTotal/ {print $2}' /proc/meminfo) kB, kernel $(uname -r)"
echo "shmem THP: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled)"
echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg) (the machine is shared)"

# ---------------------------------------------------------------- load throughput vs cp
cat "$MODEL"/*.safetensors > /dev/null  # Page cache warm for both.
SHARD_BYTES=$(cat "$MODEL"/*.safetensors | wc -c)
echo
echo "== load throughput, 4 KiB shmem pages (page cache warm), $RUNS interleaved runs"
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
: > "$WORK/cp.txt"; : > "$WORK/w2.txt"; : > "$WORK/w1.txt"; : > "$WORK/ready.txt"
for run in $(seq "$RUNS"); do
  mkdir -p /dev/shm/hmoe-measure-cp.$$
  t0=$(date +%s.%N)
  cp "$MODEL"/*.safetensors /dev/shm/hmoe-measure-cp.$$/
  t1=$(date +%s.%N)
  rm -rf /dev/shm/hmoe-measure-cp.$$
  echo "$t1 - $t0" | bc -l >> "$WORK/cp.txt"
  for threads in 2 1; do
    start_weightd "$MODEL" --hugepages off --load-threads "$threads"
    status_field load >> "$WORK/w$threads.txt"
    [ "$threads" = 2 ] && status_field startup >> "$WORK/ready.txt"
    stop_weightd
  done
done
printf "  cp into /dev/shm:         %s s (runs: %s)\n" "$(median < "$WORK/cp.txt")" "$(tr '\n' ' ' < "$WORK/cp.txt" | xargs printf '%.3f ')"
printf "  weightd, 2 load threads:  %s s (runs: %s); ready after exec (median) %s s\n" "$(median < "$WORK/w2.txt")" "$(tr '\n' ' ' < "$WORK/w2.txt")" "$(median < "$WORK/ready.txt")"
printf "  weightd, 1 load thread:   %s s (runs: %s)\n" "$(median < "$WORK/w1.txt")" "$(tr '\n' ' ' < "$WORK/w1.txt")"
cp_m=$(median < "$WORK/cp.txt"); w2_m=$(median < "$WORK/w2.txt"); w1_m=$(median < "$WORK/w1.txt")
printf "  median throughput: cp %.2f GB/s, weightd %.2f GB/s (2 threads) / %.2f GB/s (1 thread); ratio to cp %.2f / %.2f\n" \
  "$(echo "$SHARD_BYTES / $cp_m / 1000000000" | bc -l)" "$(echo "$SHARD_BYTES / $w2_m / 1000000000" | bc -l)" \
  "$(echo "$SHARD_BYTES / $w1_m / 1000000000" | bc -l)" "$(echo "$cp_m / $w2_m" | bc -l)" "$(echo "$cp_m / $w1_m" | bc -l)"

# ---------------------------------------------------------------- 2 MiB hugepages
if [ -w /proc/sys/vm/nr_hugepages ]; then
  echo
  echo "== 2 MiB hugepages (nr_hugepages $HUGE_BEFORE -> reserved for the run -> restored)"
  need=$(( SHARD_BYTES / 2097152 + 16 ))
  echo "$need" > /proc/sys/vm/nr_hugepages
  for run in 1 2 3; do
    start_weightd "$MODEL" --hugepages 2m
    load_s=$(status_field load)
    if [ "$run" = 3 ]; then
      "$INSPECT" --instance "$INSTANCE" --touch --hold > "$WORK/hold.out" &
      hold=$!
      PIDS+=("$hold")
      until grep -q holding "$WORK/hold.out"; do sleep 0.05; done
      grep -E "backing|hugetlb" "$WORK/hold.out" | sed 's/^/  /'
      echo "  weightd pid $WEIGHTD_PID: Shared_Hugetlb $(rollup "$WEIGHTD_PID" Shared_Hugetlb) kB, Private_Hugetlb $(rollup "$WEIGHTD_PID" Private_Hugetlb) kB"
      echo "  worker  pid $hold: Shared_Hugetlb $(rollup "$hold" Shared_Hugetlb) kB"
      grep "HugePages_\(Total\|Free\)" /proc/meminfo | sed 's/^/  /'
      kill -TERM "$hold"
      wait "$hold" || true
    fi
    stop_weightd
    printf "run %d: weightd load %.3f s (%.2f GB/s) with hugetlb-2m\n" "$run" "$load_s" \
      "$(echo "$SHARD_BYTES / $load_s / 1000000000" | bc -l)"
  done
  echo "$HUGE_BEFORE" > /proc/sys/vm/nr_hugepages
  echo "nr_hugepages restored to $(cat /proc/sys/vm/nr_hugepages)"
fi

# ---------------------------------------------------------------- PSS
echo
echo "== proportional set size: weightd + 3 attached processes (hmoe_weightd_attach_probe) that read every weight byte (4 KiB pages)"
for m in "$@"; do
echo "  model $m"
start_weightd "$m" --hugepages off
workers=()
for i in 1 2 3; do
  "$PROBE" "$INSTANCE" > "$WORK/w$i.out" &
  workers+=($!)
  PIDS+=($!)
done
for i in 1 2 3; do until grep -q holding "$WORK/w$i.out"; do sleep 0.05; done; done
total=0
shm=0
for p in "$WEIGHTD_PID" "${workers[@]}"; do
  pss=$(rollup "$p" Pss)
  s=$(shm_pss_kb "$p")
  printf "  pid %-7d Pss %8d kB (of which weight segments %8d kB)\n" "$p" "$pss" "$s"
  total=$(( total + pss ))
  shm=$(( shm + s ))
done
tensor_total=$(python3 - "$m" <<'PY'
import json, os, struct, sys
d = sys.argv[1]
total = 0
for f in sorted(os.listdir(d)):
    if f.endswith(".safetensors"):
        with open(os.path.join(d, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
            for k, v in h.items():
                if k != "__metadata__":
                    total += v["data_offsets"][1] - v["data_offsets"][0]
print(total)
PY
)
checkpoint_total=$(du -sb "$m" | cut -f1)
printf "  sum Pss %d kB = %.4f x checkpoint bytes (%d, every file of the directory) = %.4f x tensor bytes (%d); weight segments alone %.4f x tensor bytes\n" \
  "$total" "$(echo "$total * 1024 / $checkpoint_total" | bc -l)" "$checkpoint_total" \
  "$(echo "$total * 1024 / $tensor_total" | bc -l)" "$tensor_total" \
  "$(echo "$shm * 1024 / $tensor_total" | bc -l)"
for p in "${workers[@]}"; do kill -TERM "$p"; wait "$p" || true; done
stop_weightd

done

# ---------------------------------------------------------------- restart after kill -9
echo
echo "== kill -9 weightd while a worker holds the mappings, then start it again"
for m in "$@"; do
  "$WEIGHTD" --model "$m" --instance "$INSTANCE" 2> "$WORK/first.log" &
  first=$!
  PIDS+=("$first")
  "$INSPECT" --instance "$INSTANCE" --wait-ready-seconds 900 > /dev/null
  "$INSPECT" --instance "$INSTANCE" --touch --hold > "$WORK/held.out" &
  held=$!
  PIDS+=("$held")
  until grep -q holding "$WORK/held.out"; do sleep 0.05; done
  kill -9 "$first"
  wait "$first" || true
  start_weightd "$m"
  out=$("$INSPECT" --instance "$INSTANCE" --status)
  printf "  %-30s %s\n" "$m" "$(echo "$out" | head -1)"
  grep -o "adopted generation.*" "$WORK/weightd.log" | sed 's/^/    log: /'
  kill -TERM "$held"
  wait "$held" || true
  stop_weightd
done

# ---------------------------------------------------------------- attach time
echo
echo "== attach time of a new process (hmoe-weightd-inspect's attach_ms; 10 runs, median)"
for m in "$@"; do
  start_weightd "$m" --hugepages off
  times=$(for i in $(seq 10); do out=$("$INSPECT" --instance "$INSTANCE"); echo "$out" | sed -n 's/attach_ms=//p'; done | sort -n)
  median=$(echo "$times" | sed -n 5p)
  out=$("$INSPECT" --instance "$INSTANCE")
  printf "  %-30s %s tensors: attach median %s ms (min %s, max %s)\n" "$m" \
    "$(echo "$out" | sed -n 's/^  \([0-9]*\) tensors, \([^;]*\);.*/\1, \2/p')" \
    "$median" "$(echo "$times" | sed -n 1p)" "$(echo "$times" | sed -n 10p)"
  stop_weightd
done

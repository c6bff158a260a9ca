#!/usr/bin/env bash
# The GPU check (issue 20): on a host with an NVIDIA GPU, one command runs every test that touches
# CUDA, the GPU benchmark and the deployed stack on --gpus 1, and writes one report.
#
#   scripts/gpu_check.sh [run] [--build DIR] [--bundle FILE] [--report DIR] [--quick]
#       Builds the CUDA configuration in DIR (default build/gpu-check), or, with --bundle, unpacks
#       a bundle made by `pack` to the build path it was packed from (the test binaries embed
#       it) and runs from there. Writes DIR/report.md (or --report DIR) and exits non-zero when
#       any test failed or the stack did not agree with the CPU reference.
#   scripts/gpu_check.sh pack [--build DIR] [--out FILE]
#       On a build machine without a GPU: strips the CUDA build's executables and packs them with
#       the shared libraries a GPU host may lack (gRPC, protobuf, abseil, re2, ssl, numa, cudart,
#       ...; not cuBLAS or NCCL, which are large and come with the host's CUDA or PyTorch) into
#       FILE (default .gpu-bundle/bundle.tar.xz).
#
# cuBLAS and NCCL on the GPU host: the script looks in CUDA_HOME/lib64, /usr/local/cuda/lib64 and
# a PyTorch installation's site-packages/nvidia/*/lib and adds what it finds to LD_LIBRARY_PATH.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE=run
if [[ $# -gt 0 && "$1" != --* ]]; then
  MODE="$1"
  shift
fi
BUILD="$ROOT/build/gpu-check"
BUNDLE=""
OUT_FILE="$ROOT/.gpu-bundle/bundle.tar.xz"
REPORT=""
QUICK=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD="$(realpath -m "$2")"; shift 2 ;;
    --bundle) BUNDLE="$(realpath "$2")"; shift 2 ;;
    --out) OUT_FILE="$(realpath -m "$2")"; shift 2 ;;
    --report) REPORT="$(realpath -m "$2")"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
start=$SECONDS
say() { echo "gpu_check [$((SECONDS - start)) s]: $*"; }

# The executables the check runs: the tests (all of them: the CUDA build links every test with
# the CUDA backend, and the integration tests start the real workers), the workers and tools
# the tests and the stack start, and the benchmarks.
list_executables() {  # BUILD_DIR
  (cd "$1" && find . -type f -perm -u+x -not -path '*/CMakeFiles/*' \
     \( -name 'hmoe*' -o -name '*_bench' -o -name '*_test' \) | sed 's|^\./||' | sort)
}

# Libraries every Linux host with a GPU driver has, and the two large CUDA ones taken from the host.
is_host_library() {
  case "$1" in
    linux-vdso*|ld-linux*|libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libgcc_s.so*|\
    libstdc++.so*|libcublas.so*|libcublasLt.so*|libnccl.so*|libcuda.so*) return 0 ;;
  esac
  return 1
}

if [[ "$MODE" == pack ]]; then
  [[ -d "$BUILD" ]] || { echo "gpu_check.sh pack: no build at $BUILD" >&2; exit 2; }
  compgen -G "$BUILD/CMakeFiles/*/CMakeCUDACompiler.cmake" >/dev/null ||
    { echo "gpu_check.sh pack: $BUILD is not a CUDA build" >&2; exit 2; }
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage/tree/bundle-lib"
  mapfile -t exes < <(list_executables "$BUILD")
  declare -A libs=()
  for e in "${exes[@]}"; do
    mkdir -p "$stage/tree/$(dirname "$e")"
    strip -o "$stage/tree/$e" "$BUILD/$e"
    while read -r name path; do
      [[ -n "$path" && -f "$path" ]] || continue
      is_host_library "$name" || libs[$name]="$path"
    done < <(ldd "$BUILD/$e" | awk '/=>/ {print $1, $3}')
  done
  for name in "${!libs[@]}"; do cp -L "${libs[$name]}" "$stage/tree/bundle-lib/$name"; done
  echo "$BUILD" >"$stage/tree/bundle-build-path"
  echo "$ROOT" >"$stage/tree/bundle-source-path"
  git -C "$ROOT" rev-parse HEAD >"$stage/tree/bundle-commit" 2>/dev/null || echo unknown >"$stage/tree/bundle-commit"
  mkdir -p "$(dirname "$OUT_FILE")"
  tar -C "$stage/tree" -cf - . | xz -T0 -6 >"$OUT_FILE"
  say "packed ${#exes[@]} executables and ${#libs[@]} libraries from $BUILD into $OUT_FILE ($(du -h "$OUT_FILE" | cut -f1))"
  exit 0
fi
[[ "$MODE" == run ]] || { echo "gpu_check.sh: unknown mode '$MODE' (run or pack)" >&2; exit 2; }

if [[ -n "$BUNDLE" ]]; then
  BUILD=$(xz -dc "$BUNDLE" | tar -xOf - ./bundle-build-path)
  # The tests also embed the source path (test data, scripts): where this checkout lives
  # elsewhere, the packed path becomes a link to it.
  src=$(xz -dc "$BUNDLE" | tar -xOf - ./bundle-source-path 2>/dev/null || echo "$ROOT")
  if [[ "$src" != "$ROOT" && ! -e "$src" ]]; then
    mkdir -p "$(dirname "$src")"
    ln -s "$ROOT" "$src"
    say "linked $src to this checkout $ROOT"
  fi
  say "unpacking $BUNDLE to $BUILD"
  mkdir -p "$BUILD"
  xz -dc "$BUNDLE" | tar -C "$BUILD" -xf -
  export LD_LIBRARY_PATH="$BUILD/bundle-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  say "building the CUDA configuration in $BUILD"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DHMOE_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$BUILD" -j "$(nproc)"
fi
REPORT="${REPORT:-$BUILD/gpu-check}"
mkdir -p "$REPORT/logs"

# cuBLAS and NCCL from the host.
for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64; do
  [[ -d "$d" ]] && LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
done
py=$(command -v python3 || true)
if [[ -n "$py" ]]; then
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
  for d in "$site"/nvidia/*/lib; do [[ -d "$d" ]] && LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"; done
fi
export LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader \
  >"$REPORT/gpu.txt" 2>&1 || echo "nvidia-smi failed" >"$REPORT/gpu.txt"
say "GPU: $(cat "$REPORT/gpu.txt")"

# 1. Tests: every test binary of the CUDA build, each alone (ctest's gtest discovery needs our
# CMake, which a bundle does not carry), eight at a time; the GPU ones first and alone.
mapfile -t tests < <(list_executables "$BUILD" | grep '_test$')
gpu_first=(tests/kernels_cuda/hmoe_cuda_kernels_test tests/kernels_cuda/hmoe_cuda_device_test
           tests/device/hmoe_device_test tests/comm/hmoe_nccl_collective_test
           tests/prefill_worker/hmoe_cuda_handoff_gpu_test)
run_one() {  # REPORT BUILD TEST
  local name
  name=$(basename "$3")
  local t0=$SECONDS
  if (cd "$2" && timeout 300 "./$3" --gtest_output="xml:$1/logs/$name.xml" >"$1/logs/$name.log" 2>&1); then
    echo "$name PASS $((SECONDS - t0))"
  else
    echo "$name FAIL $((SECONDS - t0))"
  fi
}
export -f run_one
: >"$REPORT/tests.txt"
for t in "${gpu_first[@]}"; do
  [[ -x "$BUILD/$t" ]] || { echo "$(basename "$t") MISSING 0" >>"$REPORT/tests.txt"; continue; }
  run_one "$REPORT" "$BUILD" "$t" | tee -a "$REPORT/tests.txt"
done
if [[ $QUICK == 0 ]]; then
  printf '%s\n' "${tests[@]}" | grep -vxF -f <(printf '%s\n' "${gpu_first[@]}") |
    xargs -P 8 -I{} bash -c 'run_one "$0" "$1" "$2"' "$REPORT" "$BUILD" {} | tee -a "$REPORT/tests.txt"
fi
failed=$(grep -c ' FAIL \| MISSING ' "$REPORT/tests.txt" || true)
say "tests: $(grep -c ' PASS ' "$REPORT/tests.txt" || true) binaries passed, $failed failed"

{
  echo "# GPU check"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "- GPU: $(cat "$REPORT/gpu.txt")"
  echo "- CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) CPUs"
  echo "- commit: $(cat "$BUILD/bundle-commit" 2>/dev/null || git -C "$ROOT" rev-parse HEAD)"
  echo
  echo "## Tests (one line per test binary: result, seconds)"
  echo
  sed 's/^/    /' "$REPORT/tests.txt"
  for x in "$REPORT"/logs/*.log; do
    n=$(basename "$x" .log)
    if grep -q "^$n FAIL" "$REPORT/tests.txt"; then
      echo
      echo "### $n failures"
      echo
      grep -E '^\[  FAILED  \]|Failure|error:|Expected|Which is|actual' "$x" | head -40 | sed 's/^/    /'
    fi
  done
} >"$REPORT/report.md"
say "report: $REPORT/report.md"
[[ $failed == 0 ]]

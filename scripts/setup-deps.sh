#!/usr/bin/env bash
# Installs the Debian packages hybridmoe needs to build, test and run.
# Idempotent: when every package is already installed it does nothing (no apt-get update).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libboost-dev libnuma-dev numactl zlib1g-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
  supervisor clang-format
  python3 python3-venv  # the GGUF oracle test's venv (tests/model/gguf_oracle_test.py)
  nlohmann-json3-dev python3-jinja2  # JSON in common/chat; the chat-template conformance test
  prometheus-cpp-dev  # hmoe-router's /metrics (Boost.Beast, its HTTP server, is in libboost-dev)
  clang-14 libfuzzer-14-dev  # scripts/fuzz.sh and test.sh's fuzz configuration
  python3-matplotlib  # scripts/plot_bench.py: `hmoe bench` JSON to PNGs (docs/bench.md)
)

missing=()
for p in "${PACKAGES[@]}"; do
  # No `| grep -q` under pipefail (scripts/lib/common.sh says why).
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  if [[ "$status" != *"install ok installed"* ]]; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "setup-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "setup-deps: installing ${missing[*]}"
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  SUDO="sudo"
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup-deps: done"

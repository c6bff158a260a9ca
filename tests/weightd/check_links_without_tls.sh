#!/bin/sh
# check_links_without_tls.sh BINARY: BINARY (hmoe-weightd) links the unsecure gRPC build and
# nothing of the secure one or of TLS (weightd/CMakeLists.txt says why). ldd lists the whole
# closure of the binary, so a dependency that brings gRPC::grpc++ back is caught too.
set -eu
libs=$(ldd "$1")
if ! echo "$libs" | grep -q 'libgrpc_unsecure\.so'; then
  echo "$1 does not link libgrpc_unsecure:"
  echo "$libs"
  exit 1
fi
if echo "$libs" | grep -E 'libgrpc\.so|libgrpc\+\+\.so|libgrpc\+\+_reflection|libssl|libcrypto'; then
  echo "$1 links the secure gRPC build or TLS (the libraries above)"
  exit 1
fi
echo "$1 links gRPC without TLS"

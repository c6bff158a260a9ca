#!/bin/sh
# check_links_without_tls.sh BINARY: BINARY (hmoe-weightd) has the unsecure gRPC build, linked
# statically (Debian's archives, the default) or as libgrpc_unsecure.so, and nothing of the secure
# build or of TLS (weightd/CMakeLists.txt and proto/CMakeLists.txt say why). ldd lists the whole
# closure of the binary, so a dependency that brings gRPC::grpc++ back is caught too, and so is a
# shared gRPC or protobuf next to the static ones (two copies of the same symbols in one process).
set -eu
libs=$(ldd "$1")
if echo "$libs" | grep -E 'libgrpc\.so|libgrpc\+\+\.so|libgrpc\+\+_reflection|libssl|libcrypto'; then
  echo "$1 links the secure gRPC build or TLS (the libraries above)"
  exit 1
fi
if echo "$libs" | grep -q 'libgrpc_unsecure\.so'; then
  echo "$1 links gRPC without TLS (shared)"
  exit 0
fi
if ! nm "$1" | grep -q ' T grpc_init$'; then
  echo "$1 has no gRPC at all: neither libgrpc_unsecure.so nor a static grpc_init"
  exit 1
fi
if echo "$libs" | grep -E 'libgrpc|libgpr|libupb|libprotobuf'; then
  echo "$1 has gRPC linked statically and also the shared libraries above"
  exit 1
fi
echo "$1 links gRPC without TLS (static)"

#pragma once

// Factories of the ISA-specific variants of Fp8Gemv. Each lives in a source file compiled with its
// own ISA flags (see CMakeLists.txt), so only the dispatcher in fp8_gemv.cc may call them, and only
// after checking CpuSupports(). They return an owning raw pointer on purpose: a std::unique_ptr
// instantiated in an AVX-512 translation unit could be the copy the linker keeps for everyone.

#include <cstddef>
#include <cstdint>

#include "common/kernels/cpu/fp8_gemv.h"

namespace hmoe::cpu::internal {

Fp8Gemv* NewScalarFp8Gemv();
// `prefetch_bytes` < 0 disables software prefetch.
Fp8Gemv* NewAvx2Fp8Gemv(int64_t prefetch_bytes);
// `options.prefetch_bytes` is resolved (>= 0).
Fp8Gemv* NewAvx512Fp8Gemv(const Fp8GemvOptions& options);
Fp8Gemv* NewAvx512Bf16Fp8Gemv(const Fp8GemvOptions& options);
Fp8Gemv* NewAmxFp8Gemv(const Fp8GemvOptions& options);

// AMX state shared by the AMX GEMV and GEMM (defined in fp8_gemv.cc, compiled without AMX flags):
// the id of the tile configuration this thread last loaded (0: none), so a call skips LDTILECFG
// when the configuration is already in place; and a per-thread 64-byte aligned scratch buffer of
// at least `bytes` bytes (valid until the thread's next call).
int& AmxLoadedConfig();
std::byte* AmxScratch(int64_t bytes);

// Default prefetch distances (bytes beyond the next tile of rows), measured on this project's
// development machines.
inline constexpr int64_t kAvx2DefaultPrefetchBytes = 1024;
inline constexpr int64_t kAvx512DefaultPrefetchBytes = 2048;

}  // namespace hmoe::cpu::internal

#pragma once

// Helper kernels of hmoe_gpu_bench (tests/bench/gpu_bench.cc): fill buffers with deterministic
// pseudo-random data on the GPU (host generation of gigabytes would dominate the run), and a
// read-bandwidth kernel used as a yardstick. CUDA builds only.

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace hmoe::gpubench {

// p[i] = an FP8 E4M3 code of magnitude <= 1.875 with a random sign (never NaN or Inf).
cudaError_t FillFp8(uint8_t* p, size_t n, uint32_t seed, cudaStream_t stream);
// p[i] = BF16 bits of a uniform value in [-scale, scale).
cudaError_t FillBf16(uint16_t* p, size_t n, uint32_t seed, float scale, cudaStream_t stream);
// p[i] = a uniform value in [-scale, scale) (scale 0: zeros) plus `offset`.
cudaError_t FillF32(float* p, size_t n, uint32_t seed, float scale, float offset,
                    cudaStream_t stream);
// Reads n16 16-byte words at p (16-byte aligned) with the whole GPU; writes one word to *sink
// only when the data XOR-reduces to a value random data never gives (so nothing is elided).
cudaError_t ReadAll(const void* p, size_t n16, uint32_t* sink, int blocks, int threads,
                    cudaStream_t stream);
// The launch shape that fills the GPU for ReadAll (blocks, threads).
cudaError_t ReadAllShape(int* blocks, int* threads);

}  // namespace hmoe::gpubench

// Helper kernels of hmoe_gpu_bench: see gpu_bench_kernels.h.

#include <algorithm>

#include "tests/bench/gpu_bench_kernels.h"

namespace hmoe::gpubench {
namespace {

__device__ __forceinline__ uint32_t Hash(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull + 1;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint32_t>(x >> 16);
}

__device__ __forceinline__ float Uniform(uint64_t i, uint32_t seed) {
  return static_cast<float>(Hash(i, seed) & 0xFFFFFF) * (2.0f / 16777216.0f) - 1.0f;
}

__global__ void FillFp8Kernel(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint32_t h = Hash(i, seed);
    p[i] = static_cast<uint8_t>((h & 0x3F) | ((h >> 8) & 0x80));  // exponent <= 7: |v| <= 1.875
  }
}

__global__ void FillBf16Kernel(uint16_t* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float v = Uniform(i, seed) * scale;
    p[i] = static_cast<uint16_t>(__float_as_uint(v) >> 16);
  }
}

__global__ void FillF32Kernel(float* p, size_t n, uint32_t seed, float scale, float offset) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    p[i] = Uniform(i, seed) * scale + offset;
  }
}

__global__ void ReadAllKernel(const uint4* __restrict__ p, size_t n, uint32_t* sink) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  uint32_t acc = 0;
  // Four independent 16-byte loads in flight per thread per iteration.
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(p + i);
    const uint4 b = __ldcs(p + i + stride);
    const uint4 c = __ldcs(p + i + 2 * stride);
    const uint4 d = __ldcs(p + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^
           d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;
}

constexpr int kFillThreads = 256;

int FillBlocks(size_t n) {
  return static_cast<int>(std::min<size_t>((n + kFillThreads - 1) / kFillThreads, 65536));
}

}  // namespace

cudaError_t FillFp8(uint8_t* p, size_t n, uint32_t seed, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  FillFp8Kernel<<<FillBlocks(n), kFillThreads, 0, stream>>>(p, n, seed);
  return cudaGetLastError();
}

cudaError_t FillBf16(uint16_t* p, size_t n, uint32_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  FillBf16Kernel<<<FillBlocks(n), kFillThreads, 0, stream>>>(p, n, seed, scale);
  return cudaGetLastError();
}

cudaError_t FillF32(float* p, size_t n, uint32_t seed, float scale, float offset,
                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  FillF32Kernel<<<FillBlocks(n), kFillThreads, 0, stream>>>(p, n, seed, scale, offset);
  return cudaGetLastError();
}

cudaError_t ReadAll(const void* p, size_t n16, uint32_t* sink, int blocks, int threads,
                    cudaStream_t stream) {
  ReadAllKernel<<<blocks, threads, 0, stream>>>(static_cast<const uint4*>(p), n16, sink);
  return cudaGetLastError();
}

cudaError_t ReadAllShape(int* blocks, int* threads) {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  int sms = 0;
  if (const cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      err != cudaSuccess) {
    return err;
  }
  *threads = 512;
  int per_sm = 0;
  if (const cudaError_t err =
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ReadAllKernel, *threads, 0);
      err != cudaSuccess) {
    return err;
  }
  *blocks = sms * std::max(per_sm, 1);
  return cudaSuccess;
}

}  // namespace hmoe::gpubench

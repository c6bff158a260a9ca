#pragma once

// Helpers shared by the CPU kernel and MoE benchmarks: big cold buffers, a STREAM-like read
// kernel, and timing taken inside the worker threads (on a 2-vCPU machine the caller may be woken
// late, so wall time is max(end) - min(start) over the workers' own clocks).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/kernels/cpu/fp8_gemv.h"
#include "common/ops/cpu/cpu_worker_pool.h"

namespace hmoe::bench {

// An anonymous mapping with transparent huge pages requested, first-touched (so page faults stay
// out of timed regions). Aborts when the memory cannot be mapped.
class HugeBuffer {
 public:
  explicit HugeBuffer(size_t bytes);
  ~HugeBuffer();
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  void* base_ = nullptr;
  size_t mapped_ = 0;
};

// Fills `n` bytes with random FP8 E4M3 codes, never NaN (real checkpoints have none).
void FillRandomFp8(std::byte* p, size_t n, uint64_t seed);

// Sums `bytes` (a multiple of 512, 64-byte aligned) with wide loads and several accumulators;
// the result only defeats dead-code elimination.
float ReadSum(const std::byte* p, size_t bytes);

// The same bytes read as 8 interleaved streams (8 equal regions) with software prefetch 1 KiB
// ahead in each: on cores whose bandwidth is limited by misses in flight (Ice Lake: ~15 vs ~11
// GB/s) this is the achievable read bandwidth, the fair reference for a prefetching kernel.
float ReadSumStreams(const std::byte* p, size_t bytes);

// The read kernels the benchmarks take the best of ("best read bandwidth", the upper bound of a
// kernel that streams its operand once): STREAM-like linear (ReadSum), 8 prefetched streams
// (ReadSumStreams), and 4 streams prefetched 2 KiB ahead into L1 or 4 KiB ahead into L2
// (AVX-512; the AVX2 fallback is the 8-stream kernel).
enum class ReadKernel { kLinear, kStreams8, kStreams4T0, kStreams4T1 };
inline constexpr ReadKernel kAllReadKernels[] = {ReadKernel::kLinear, ReadKernel::kStreams8,
                                                 ReadKernel::kStreams4T0, ReadKernel::kStreams4T1};
const char* ReadKernelName(ReadKernel kernel);
float ReadSumWith(ReadKernel kernel, const std::byte* p, size_t bytes);

// The pool for `threads` threads on one node (cached; threads 1..n-1 pinned).
CpuWorkerPool& PoolForThreads(int threads);

// Per-thread start/end timestamps of one parallel region.
class WorkerTimes {
 public:
  explicit WorkerTimes(int threads) : start_(threads), end_(threads) {}
  void Start(int thread);
  void End(int thread);
  // max(end) - min(start), in seconds.
  double WallSeconds() const;

 private:
  std::vector<int64_t> start_;
  std::vector<int64_t> end_;
};

// Runs fn(thread) on `pool` with timestamps taken in each worker; returns the wall seconds.
double TimedRun(CpuWorkerPool& pool, const std::function<void(int)>& fn);

// Reads [p, p + bytes) split evenly over the pool's threads (p 64-byte aligned); returns GB/s
// (1e9 bytes per second).
double TimedReadGBps(CpuWorkerPool& pool, const std::byte* p, size_t bytes);
// The same with ReadSumStreams.
double TimedReadStreamsGBps(CpuWorkerPool& pool, const std::byte* p, size_t bytes);

// The same with any read kernel.
double TimedReadKernelGBps(CpuWorkerPool& pool, ReadKernel kernel, const std::byte* p,
                           size_t bytes);

// Rows [begin, end) of `rows` for thread t of n, on multiples of 128 rows (scale blocks).
void SplitRows(int64_t rows, int t, int n, int64_t* begin, int64_t* end);

// Register-only peak loops per instruction mix (hmoe_kernels_bench's BM_Peak, hmoe_gemm_bench's
// peak fractions): kPeakAcc independent accumulators (more than latency x throughput of every core
// we use), no memory operands. Ops count 2 per multiply-add.
// kBf16TileAmx: TDPBF16PS on 16x64-byte tiles (4 independent C tiles; one instruction is
// 16 x 16 x 32 multiply-adds).
enum class Mix {
  kF32FmaAvx2,
  kF32FmaAvx512,
  kBf16DotAvx512,
  kInt8DotAvx512Vnni,
  kInt8DotAvxVnni,
  kBf16TileAmx
};
inline constexpr Mix kAllMixes[] = {Mix::kF32FmaAvx2,     Mix::kF32FmaAvx512,
                                    Mix::kBf16DotAvx512,  Mix::kInt8DotAvx512Vnni,
                                    Mix::kInt8DotAvxVnni, Mix::kBf16TileAmx};
inline constexpr int kPeakAcc = 12;
const char* MixName(Mix m);
bool MixSupported(Mix m);
// Ops (2 per multiply-add) of one instruction of the mix.
double OpsPerInstruction(Mix m);
// Runs `iters` iterations of kPeakAcc instructions of `m` (which the CPU must support); the
// result only defeats dead-code elimination.
float RunPeakLoop(Mix m, int64_t iters);
// The instruction mix of an FP8 GEMV (or GEMM) variant's inner loop.
Mix MixOf(cpu::CpuIsa isa);
// The int8 dot-product peak for a quantized-kernel (QuantGemv) variant: vpdpbusd zmm for the
// AVX-512 ones, vpdpbusd ymm (AVX-VNNI) for AVX2 where the CPU has it (else the FP32 FMA mix).
Mix Int8MixOf(cpu::CpuIsa isa);

}  // namespace hmoe::bench

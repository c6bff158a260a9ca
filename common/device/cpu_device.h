#pragma once

// CpuDevice: the Device on the host (always available). Device memory is host memory, so weights
// are read in place (weightd's mapping, an mmapped checkpoint) and copies are memcpy.
//
// Streams execute synchronously: every copy and op runs to completion in the calling thread
// before the call returns (ops split their work over the CpuWorkerPool given in the options, the
// calling thread taking part). Events are therefore complete as soon as they are recorded and
// Stream::WaitEvent never waits. Two threads driving two streams of one CpuDevice (dual-batch)
// run their ops one at a time on the pool (see CpuPoolMutex).
//
// A memory budget makes the device behave like a small GPU (Allocate fails, AllocateBlocking
// waits), and a copy bandwidth cap makes CopyToDevice take bytes / cap seconds, so SLP's overlap
// of loading with compute is observable on a machine without a GPU.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

#include "common/device/device.h"
#include "common/kernels/cpu/fp8_gemv.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "common/ops/cpu/quantized_linear.h"

namespace hmoe {

struct CpuDeviceOptions {
  // Allocation budget in bytes; 0: unlimited.
  size_t budget_bytes = 0;
  // Bandwidth cap of CopyToDevice in bytes per second (the copy sleeps until bytes / cap seconds
  // have passed since it started); 0: no cap. Other copies are not capped.
  double copy_bytes_per_second = 0.0;
  // Threads for the ops; not owned, must outlive the device. Null: ops run on the calling thread
  // alone.
  CpuWorkerPool* pool = nullptr;
  // FP8 kernels; null: cpu::DefaultFp8Gemv().
  const cpu::Fp8Gemv* fp8_gemv = nullptr;
  // FP8 linear layers of at least this many tokens (prefill chunks, grouped experts) run on the
  // Fp8Gemm of fp8_gemv's ISA instead of the GEMV; INT64_MAX: never; -1 (default):
  // cpu::Fp8GemmMinTokens(isa), the measured crossover, where cpu::Fp8GemmMatchesGemv(isa), else
  // never (a token's result must not depend on its batch; see fp8_gemm.h). Setting it otherwise
  // trades that bitwise batch-invariance for speed (results still agree to F32 rounding).
  int64_t fp8_gemm_min_tokens = -1;
  // Products with GGML block-type weights (GGUF): activations rounded to Q8_K and the integer
  // kernels of cpu::DefaultQuantGemv() (kQ8K, llama.cpp's numerics), or dequantized weight rows
  // and F32 dot products (kF32, the reference's numerics; slow). Default: HMOE_QUANT_ACTIVATIONS
  // (common/ops/cpu/quantized_linear.h), q8k when unset.
  cpu::QuantActivations quant_activations = cpu::DefaultQuantActivations();
};

// Never fails.
std::unique_ptr<Device> NewCpuDevice(const CpuDeviceOptions& options = {});

// The mutex that serializes CpuWorkerPool::Run on `pool` between threads: Run must not overlap,
// so code that runs a pool from threads that may be concurrent (CpuDevice ops, the engine's
// MoE on the same pool in dual-batch mode) holds this mutex around its Run calls. One mutex per
// pool for the life of the process. (A std::mutex: see common/device/sync_internal.h.)
std::mutex& CpuPoolMutex(const CpuWorkerPool* pool);

}  // namespace hmoe

#include "tests/bench/bench_util.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>

// GCC 12 reports its own _mm*_undefined_*() helpers as uninitialized (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include "common/base/logging.h"
#include "common/kernels/cpu/fp8_gemv_internal.h"

namespace hmoe::bench {
namespace {

volatile float g_sink = 0;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// noipa: GCC's IPA would otherwise mark these pure and hoist repeated calls out of timing loops.
__attribute__((noipa, target("avx512f"))) float ReadSumAvx512(const std::byte* p, size_t bytes) {
  __m512 a[8];
  for (__m512& v : a) v = _mm512_setzero_ps();
  const float* f = reinterpret_cast<const float*>(p);
  for (size_t i = 0; i < bytes / 4; i += 128) {
    for (int j = 0; j < 8; ++j) a[j] = _mm512_add_ps(a[j], _mm512_load_ps(f + i + 16 * j));
  }
  for (int j = 1; j < 8; ++j) a[0] = _mm512_add_ps(a[0], a[j]);
  alignas(64) float out[16];
  _mm512_store_ps(out, a[0]);
  return out[0];
}

__attribute__((noipa, target("avx512f"))) float ReadSumStreamsAvx512(const std::byte* p,
                                                                     size_t bytes) {
  constexpr int kStreams = 8;
  constexpr size_t kAhead = 1024;
  __m512 a[kStreams];
  for (__m512& v : a) v = _mm512_setzero_ps();
  const size_t part = bytes / kStreams / 128 * 128;
  for (size_t i = 0; i < part; i += 128) {
    for (int s = 0; s < kStreams; ++s) {
      const std::byte* q = p + s * part + i;
      _mm_prefetch(reinterpret_cast<const char*>(q + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + kAhead + 64), _MM_HINT_T0);
      a[s] = _mm512_add_ps(a[s],
                           _mm512_add_ps(_mm512_load_ps(reinterpret_cast<const float*>(q)),
                                         _mm512_load_ps(reinterpret_cast<const float*>(q + 64))));
    }
  }
  for (int s = 1; s < kStreams; ++s) a[0] = _mm512_add_ps(a[0], a[s]);
  alignas(64) float out[16];
  _mm512_store_ps(out, a[0]);
  return out[0];
}

__attribute__((noipa, target("avx2"))) float ReadSumAvx2(const std::byte* p, size_t bytes) {
  __m256 a[8];
  for (__m256& v : a) v = _mm256_setzero_ps();
  const float* f = reinterpret_cast<const float*>(p);
  for (size_t i = 0; i < bytes / 4; i += 64) {
    for (int j = 0; j < 8; ++j) a[j] = _mm256_add_ps(a[j], _mm256_load_ps(f + i + 8 * j));
  }
  for (int j = 1; j < 8; ++j) a[0] = _mm256_add_ps(a[0], a[j]);
  alignas(32) float out[8];
  _mm256_store_ps(out, a[0]);
  return out[0];
}

__attribute__((noipa, target("avx2"))) float ReadSumStreamsAvx2(const std::byte* p, size_t bytes) {
  constexpr int kStreams = 8;
  constexpr size_t kAhead = 1024;
  __m256 a[kStreams];
  for (__m256& v : a) v = _mm256_setzero_ps();
  const size_t part = bytes / kStreams / 128 * 128;
  for (size_t i = 0; i < part; i += 64) {
    for (int s = 0; s < kStreams; ++s) {
      const std::byte* q = p + s * part + i;
      _mm_prefetch(reinterpret_cast<const char*>(q + kAhead), _MM_HINT_T0);
      a[s] = _mm256_add_ps(a[s],
                           _mm256_add_ps(_mm256_load_ps(reinterpret_cast<const float*>(q)),
                                         _mm256_load_ps(reinterpret_cast<const float*>(q + 32))));
    }
  }
  for (int s = 1; s < kStreams; ++s) a[0] = _mm256_add_ps(a[0], a[s]);
  alignas(32) float out[8];
  _mm256_store_ps(out, a[0]);
  return out[0];
}

// Four streams, two lines per stream and step, prefetched `ahead` bytes ahead into L2
// (prefetcht1) or L1 (prefetcht0): fewer, longer streams than ReadSumStreamsAvx512.
template <int kHint>
__attribute__((noipa, target("avx512f"))) float ReadSumStreams4Avx512(const std::byte* p,
                                                                      size_t bytes, size_t ahead) {
  constexpr int kStreams = 4;
  __m512 a[2 * kStreams];
  for (__m512& v : a) v = _mm512_setzero_ps();
  const size_t part = bytes / kStreams / 128 * 128;
  for (size_t i = 0; i < part; i += 128) {
    for (int s = 0; s < kStreams; ++s) {
      const std::byte* q = p + s * part + i;
      _mm_prefetch(reinterpret_cast<const char*>(q + ahead), static_cast<_mm_hint>(kHint));
      _mm_prefetch(reinterpret_cast<const char*>(q + ahead + 64), static_cast<_mm_hint>(kHint));
      a[2 * s] = _mm512_add_ps(a[2 * s], _mm512_load_ps(reinterpret_cast<const float*>(q)));
      a[2 * s + 1] =
          _mm512_add_ps(a[2 * s + 1], _mm512_load_ps(reinterpret_cast<const float*>(q + 64)));
    }
  }
  for (int s = 1; s < 2 * kStreams; ++s) a[0] = _mm512_add_ps(a[0], a[s]);
  alignas(64) float out[16];
  _mm512_store_ps(out, a[0]);
  return out[0];
}

__attribute__((noipa, target("avx2,fma"))) float PeakF32Avx2(int64_t iters) {
  __m256 acc[kPeakAcc];
  for (int i = 0; i < kPeakAcc; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kPeakAcc; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  for (int i = 1; i < kPeakAcc; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  return _mm256_cvtss_f32(acc[0]);
}

__attribute__((noipa, target("avx512f"))) float PeakF32Avx512(int64_t iters) {
  __m512 acc[kPeakAcc];
  for (int i = 0; i < kPeakAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kPeakAcc; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  for (int i = 1; i < kPeakAcc; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  return _mm512_cvtss_f32(acc[0]);
}

__attribute__((noipa, target("avx512f,avx512bf16"))) float PeakBf16Avx512(int64_t iters) {
  __m512 acc[kPeakAcc];
  for (int i = 0; i < kPeakAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512i a = _mm512_set1_epi16(0x3f80), b = _mm512_set1_epi16(0x3a80);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kPeakAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)b);
  }
  for (int i = 1; i < kPeakAcc; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  return _mm512_cvtss_f32(acc[0]);
}

__attribute__((noipa, target("avx512f,avx512vnni"))) float PeakInt8Avx512(int64_t iters) {
  __m512i acc[kPeakAcc];
  for (int i = 0; i < kPeakAcc; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kPeakAcc; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  }
  for (int i = 1; i < kPeakAcc; ++i) acc[0] = _mm512_add_epi32(acc[0], acc[i]);
  return static_cast<float>(_mm_cvtsi128_si32(_mm512_castsi512_si128(acc[0])));
}

__attribute__((noipa, target("avx2,avxvnni"))) float PeakInt8AvxVnni(int64_t iters) {
  __m256i acc[kPeakAcc];
  for (int i = 0; i < kPeakAcc; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kPeakAcc; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], a, b);
  }
  for (int i = 1; i < kPeakAcc; ++i) acc[0] = _mm256_add_epi32(acc[0], acc[i]);
  return static_cast<float>(_mm_cvtsi128_si32(_mm256_castsi256_si128(acc[0])));
}

// TDPBF16PS only: the 8 tiles configured 16 rows x 64 bytes, 4 independent accumulators (C tiles
// 0-3 from A tiles 4/5 and B tiles 6/7), kPeakAcc instructions per iteration. The tiles hold
// whatever the zeroing gives (zeros): the timing does not depend on the values.
float PeakAmxBf16(int64_t iters) {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
  asm volatile(
      "tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3\n\t"
      "tilezero %%tmm4\n\ttilezero %%tmm5\n\ttilezero %%tmm6\n\ttilezero %%tmm7" ::);
  static_assert(kPeakAcc == 12);
  for (int64_t it = 0; it < iters; ++it) {
    asm volatile(
        "tdpbf16ps %%tmm6, %%tmm4, %%tmm0\n\ttdpbf16ps %%tmm7, %%tmm4, %%tmm1\n\t"
        "tdpbf16ps %%tmm6, %%tmm5, %%tmm2\n\ttdpbf16ps %%tmm7, %%tmm5, %%tmm3\n\t"
        "tdpbf16ps %%tmm6, %%tmm4, %%tmm0\n\ttdpbf16ps %%tmm7, %%tmm4, %%tmm1\n\t"
        "tdpbf16ps %%tmm6, %%tmm5, %%tmm2\n\ttdpbf16ps %%tmm7, %%tmm5, %%tmm3\n\t"
        "tdpbf16ps %%tmm6, %%tmm4, %%tmm0\n\ttdpbf16ps %%tmm7, %%tmm4, %%tmm1\n\t"
        "tdpbf16ps %%tmm6, %%tmm5, %%tmm2\n\ttdpbf16ps %%tmm7, %%tmm5, %%tmm3" ::);
  }
  alignas(64) float out[16 * 16];
  asm volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"(out), "r"(64L) : "memory");
  // The kernels cache the configuration they loaded last on this thread: it is gone now.
  cpu::internal::AmxLoadedConfig() = 0;
  return out[0];
}

}  // namespace

HugeBuffer::HugeBuffer(size_t bytes) : bytes_(bytes) {
  constexpr size_t kHuge = 2 << 20;
  const size_t mapped = (bytes + 2 * kHuge - 1) / kHuge * kHuge + kHuge;
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  HMOE_CHECK(p != MAP_FAILED) << "mmap " << mapped << " bytes";
  // Align to 2 MiB so whole huge pages back the buffer; the rest of the mapping stays unused.
  auto* aligned =
      reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(p) + kHuge - 1) / kHuge * kHuge);
  madvise(aligned, bytes, MADV_HUGEPAGE);
  std::memset(aligned, 0, bytes);
  data_ = aligned;
  base_ = p;
  mapped_ = mapped;
}

HugeBuffer::~HugeBuffer() { munmap(base_, mapped_); }

void FillRandomFp8(std::byte* p, size_t n, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < n; i += 8) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    uint64_t v = s;
    for (size_t j = 0; j < 8 && i + j < n; ++j, v >>= 8) {
      uint8_t c = static_cast<uint8_t>(v);
      if ((c & 0x7f) == 0x7f) c ^= 0x01;  // no NaN codes
      p[i + j] = static_cast<std::byte>(c);
    }
  }
}

float ReadSum(const std::byte* p, size_t bytes) {
  static const bool kAvx512 = __builtin_cpu_supports("avx512f");
  return kAvx512 ? ReadSumAvx512(p, bytes) : ReadSumAvx2(p, bytes);
}

float ReadSumStreams(const std::byte* p, size_t bytes) {
  static const bool kAvx512 = __builtin_cpu_supports("avx512f");
  return kAvx512 ? ReadSumStreamsAvx512(p, bytes) : ReadSumStreamsAvx2(p, bytes);
}

const char* ReadKernelName(ReadKernel kernel) {
  switch (kernel) {
    case ReadKernel::kLinear:
      return "linear";
    case ReadKernel::kStreams8:
      return "8streams_pf1k";
    case ReadKernel::kStreams4T0:
      return "4streams_t0_2k";
    case ReadKernel::kStreams4T1:
      return "4streams_t1_4k";
  }
  return "?";
}

float ReadSumWith(ReadKernel kernel, const std::byte* p, size_t bytes) {
  static const bool kAvx512 = __builtin_cpu_supports("avx512f");
  switch (kernel) {
    case ReadKernel::kLinear:
      return ReadSum(p, bytes);
    case ReadKernel::kStreams8:
      return ReadSumStreams(p, bytes);
    case ReadKernel::kStreams4T0:
      return kAvx512 ? ReadSumStreams4Avx512<_MM_HINT_T0>(p, bytes, 2048)
                     : ReadSumStreamsAvx2(p, bytes);
    case ReadKernel::kStreams4T1:
      return kAvx512 ? ReadSumStreams4Avx512<_MM_HINT_T1>(p, bytes, 4096)
                     : ReadSumStreamsAvx2(p, bytes);
  }
  return 0;
}

CpuWorkerPool& PoolForThreads(int threads) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<CpuWorkerPool>> pools;
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<CpuWorkerPool>& pool = pools[threads];
  if (pool == nullptr) {
    CpuWorkerPoolOptions options;
    options.num_nodes = 1;
    options.threads_per_node = threads;
    auto created = CpuWorkerPool::Create(options);
    HMOE_CHECK_OK(created.status());
    pool = std::move(*created);
  }
  return *pool;
}

void WorkerTimes::Start(int thread) { start_[thread] = NowNs(); }
void WorkerTimes::End(int thread) { end_[thread] = NowNs(); }

double WorkerTimes::WallSeconds() const {
  return static_cast<double>(*std::max_element(end_.begin(), end_.end()) -
                             *std::min_element(start_.begin(), start_.end())) *
         1e-9;
}

double TimedRun(CpuWorkerPool& pool, const std::function<void(int)>& fn) {
  WorkerTimes times(pool.num_threads());
  pool.Run([&](int t) {
    times.Start(t);
    fn(t);
    times.End(t);
  });
  return times.WallSeconds();
}

double TimedReadGBps(CpuWorkerPool& pool, const std::byte* p, size_t bytes) {
  const int n = pool.num_threads();
  const size_t part = bytes / n / 512 * 512;
  std::vector<float> sink(n);
  const double seconds = TimedRun(pool, [&](int t) { sink[t] = ReadSum(p + t * part, part); });
  g_sink = g_sink + sink[0];
  return static_cast<double>(part * n) / seconds * 1e-9;
}

double TimedReadStreamsGBps(CpuWorkerPool& pool, const std::byte* p, size_t bytes) {
  const int n = pool.num_threads();
  const size_t part = bytes / n / 1024 * 1024;
  std::vector<float> sink(n);
  const double seconds =
      TimedRun(pool, [&](int t) { sink[t] = ReadSumStreams(p + t * part, part); });
  g_sink = g_sink + sink[0];
  return static_cast<double>(part * n) / seconds * 1e-9;
}

double TimedReadKernelGBps(CpuWorkerPool& pool, ReadKernel kernel, const std::byte* p,
                           size_t bytes) {
  const int n = pool.num_threads();
  const size_t part = bytes / n / 1024 * 1024;
  std::vector<float> sink(n);
  const double seconds =
      TimedRun(pool, [&](int t) { sink[t] = ReadSumWith(kernel, p + t * part, part); });
  g_sink = g_sink + sink[0];
  return static_cast<double>(part * n) / seconds * 1e-9;
}

void SplitRows(int64_t rows, int t, int n, int64_t* begin, int64_t* end) {
  const int64_t blocks = (rows + 127) / 128;
  *begin = std::min(rows, blocks * t / n * 128);
  *end = std::min(rows, blocks * (t + 1) / n * 128);
}

const char* MixName(Mix m) {
  switch (m) {
    case Mix::kF32FmaAvx2:
      return "f32_fma_avx2";
    case Mix::kF32FmaAvx512:
      return "f32_fma_avx512";
    case Mix::kBf16DotAvx512:
      return "bf16_dot_vdpbf16ps";
    case Mix::kInt8DotAvx512Vnni:
      return "int8_dot_vpdpbusd_zmm";
    case Mix::kInt8DotAvxVnni:
      return "int8_dot_vpdpbusd_ymm";
    case Mix::kBf16TileAmx:
      return "amx_bf16";
  }
  return "?";
}

bool MixSupported(Mix m) {
  __builtin_cpu_init();
  switch (m) {
    case Mix::kF32FmaAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Mix::kF32FmaAvx512:
      return __builtin_cpu_supports("avx512f");
    case Mix::kBf16DotAvx512:
      return __builtin_cpu_supports("avx512bf16");
    case Mix::kInt8DotAvx512Vnni:
      return __builtin_cpu_supports("avx512vnni");
    case Mix::kInt8DotAvxVnni:
      return __builtin_cpu_supports("avxvnni");
    case Mix::kBf16TileAmx:
      return cpu::CpuSupports(cpu::CpuIsa::kAmx);  // also asks the OS for the tile state
  }
  return false;
}

// Ops (2 per multiply-add) of one instruction of the mix.
double OpsPerInstruction(Mix m) {
  switch (m) {
    case Mix::kF32FmaAvx2:
      return 16;  // 8 lanes
    case Mix::kF32FmaAvx512:
      return 32;  // 16 lanes
    case Mix::kBf16DotAvx512:
      return 64;  // 16 lanes x 2 products
    case Mix::kInt8DotAvx512Vnni:
      return 128;  // 16 lanes x 4 products
    case Mix::kInt8DotAvxVnni:
      return 64;  // 8 lanes x 4 products
    case Mix::kBf16TileAmx:
      return 16 * 16 * 32 * 2;  // 16 rows x 16 columns x 32 products
  }
  return 0;
}

float RunPeakLoop(Mix m, int64_t iters) {
  switch (m) {
    case Mix::kF32FmaAvx2:
      return PeakF32Avx2(iters);
    case Mix::kF32FmaAvx512:
      return PeakF32Avx512(iters);
    case Mix::kBf16DotAvx512:
      return PeakBf16Avx512(iters);
    case Mix::kInt8DotAvx512Vnni:
      return PeakInt8Avx512(iters);
    case Mix::kInt8DotAvxVnni:
      return PeakInt8AvxVnni(iters);
    case Mix::kBf16TileAmx:
      return PeakAmxBf16(iters);
  }
  return 0;
}

// The instruction mix of an FP8 GEMV variant's inner loop.
Mix MixOf(cpu::CpuIsa isa) {
  switch (isa) {
    case cpu::CpuIsa::kAmx:
      return Mix::kBf16TileAmx;
    case cpu::CpuIsa::kAvx512Bf16:
      return Mix::kBf16DotAvx512;
    case cpu::CpuIsa::kAvx512:
      return Mix::kF32FmaAvx512;
    default:
      return Mix::kF32FmaAvx2;
  }
}

Mix Int8MixOf(cpu::CpuIsa isa) {
  if (isa == cpu::CpuIsa::kAvx512 || isa == cpu::CpuIsa::kAvx512Bf16 || isa == cpu::CpuIsa::kAmx) {
    return Mix::kInt8DotAvx512Vnni;
  }
  if (isa == cpu::CpuIsa::kAvx2 && MixSupported(Mix::kInt8DotAvxVnni)) return Mix::kInt8DotAvxVnni;
  return Mix::kF32FmaAvx2;
}

}  // namespace hmoe::bench

// CPU FP8 GEMV benchmarks (issue #7), with the machine's peaks (issue 15): BM_Peak/<mix> runs
// register-only loops per instruction mix (F32 FMA on AVX2 and AVX-512, vdpbf16ps, vpdpbusd) and
// every GEMV case prints `peak_frac` (its multiply-adds over the peak of its variant's mix) next
// to `bw_frac_best` (over the best of the read kernels, BM_ReadKernels, timed in the same
// iteration). The context header names the CPU model and the dispatched variant. Every GEMV case is
// paired with reads of equally large cold buffers in the same iteration, so `bw_frac` (GEMV GB/s
// over the adjacent STREAM-like read GB/s) holds even when the machine's bandwidth changes within a
// run; `bw_frac_best` divides by the better of that read and an 8-stream prefetching read (cores
// limited by misses in flight read faster with software prefetch, as the GEMV does). Weights rotate
// through more than 1 GiB of buffers, so nothing is served from L3. Timestamps are taken inside the
// workers. A full run needs about 6 GB of memory (kernel rotation, FP32 copies, 65 real-shaped
// experts).
//
//   hmoe_kernels_bench [--benchmark_filter=...] [--benchmark_repetitions=N]
//   smoke: hmoe_kernels_bench --benchmark_filter='BM_Fp8Gemv/expert_down.*threads:1'
//          --benchmark_min_time=0.01

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

// GCC 12 reports its own _mm*_undefined_*() helpers as uninitialized (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/kernels/cpu/bf16_gemv.h"
#include "common/kernels/cpu/fp8_gemv.h"
#include "common/kernels/shared_math.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/moe_layer_bench.h"

#if HMOE_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace hmoe::bench {
namespace {

using cpu::CpuIsa;
using cpu::Fp8Gemv;
using cpu::Fp8MatrixView;

constexpr size_t kRotationBytes = size_t{1280} << 20;  // > 1 GiB: far beyond any L3

struct Shape {
  int64_t rows;
  int64_t cols;
  const char* name;
};

// DeepSeek-V3 and Kimi-K2 share the expert shapes (hidden 7168, moe_intermediate 2048).
constexpr Shape kGateUp = {2048, 7168, "expert_gate_up"};
constexpr Shape kDown = {7168, 2048, "expert_down"};
// Kimi-K2 attention (64 heads): q_b_proj [64*192, 1536] and o_proj [7168, 64*128].
constexpr Shape kKimiQb = {12288, 1536, "kimi_q_b_proj"};
constexpr Shape kKimiO = {7168, 8192, "kimi_o_proj"};

// FP8 weights of every shape live in one shared cold buffer, carved into as many matrices as fit.
HugeBuffer& Fp8Rotation() {
  static HugeBuffer* buffer = [] {
    auto* b = new HugeBuffer(kRotationBytes);
    FillRandomFp8(b->data(), b->size(), 42);
    return b;
  }();
  return *buffer;
}

struct Fp8Set {
  std::vector<float> scales;  // per matrix, ceil(rows/128) x ceil(cols/128)
  std::vector<Fp8MatrixView> views;
};

const Fp8Set& Fp8Matrices(const Shape& shape) {
  static std::map<std::pair<int64_t, int64_t>, Fp8Set> sets;
  Fp8Set& set = sets[{shape.rows, shape.cols}];
  if (set.views.empty()) {
    const int64_t bytes = shape.rows * shape.cols;
    const int64_t count = static_cast<int64_t>(Fp8Rotation().size()) / bytes;
    const int64_t blocks = ((shape.rows + 127) / 128) * ((shape.cols + 127) / 128);
    set.scales.resize(count * blocks);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> dist(1e-4f, 4e-3f);
    for (float& s : set.scales) s = dist(rng);
    for (int64_t i = 0; i < count; ++i) {
      set.views.push_back(
          Fp8MatrixView::Dense(reinterpret_cast<const uint8_t*>(Fp8Rotation().data()) + i * bytes,
                               set.scales.data() + i * blocks, shape.rows, shape.cols));
    }
  }
  return set;
}

int64_t WeightBytes(const Fp8MatrixView& w) {
  return w.rows * w.cols + ((w.rows + 127) / 128) * ((w.cols + 127) / 128) * 4;
}

struct PackedX {
  std::vector<std::byte> storage;
  std::byte* data;
  int64_t stride;
};

PackedX PackRandom(const Fp8Gemv& gemv, int64_t k, int n) {
  PackedX p;
  p.stride = gemv.PackedBytes(k);
  p.storage.resize(n * p.stride + 64);
  p.data = p.storage.data() + (64 - reinterpret_cast<uintptr_t>(p.storage.data()) % 64) % 64;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(k);
  for (int t = 0; t < n; ++t) {
    for (float& v : x) v = dist(rng);
    gemv.Pack(x.data(), k, 0, k, p.data + t * p.stride);
  }
  return p;
}

// Runs the GEMV of `w` on the pool's threads (rows split on scale blocks); returns wall seconds.
double TimedGemv(CpuWorkerPool& pool, const Fp8Gemv& gemv, const Fp8MatrixView& w, const PackedX& x,
                 int n, std::vector<float>& y) {
  const int threads = pool.num_threads();
  return TimedRun(pool, [&](int t) {
    int64_t begin, end;
    SplitRows(w.rows, t, threads, &begin, &end);
    if (begin < end) {
      gemv.MatVec(w, x.data, x.stride, n, begin, end, y.data() + begin, w.rows);
    }
  });
}

// ------------------------------------------------------------------ peaks

volatile float g_peak_sink = 0;

// Gops/s of `m` on every thread of the pool (one run of `iters` iterations per thread).
double MeasurePeakGops(CpuWorkerPool& pool, Mix m, int64_t iters) {
  std::vector<float> sink(pool.num_threads());
  const double s = TimedRun(pool, [&](int t) { sink[t] = RunPeakLoop(m, iters); });
  g_peak_sink = g_peak_sink + sink[0];
  return static_cast<double>(pool.num_threads()) * static_cast<double>(iters) * kPeakAcc *
         OpsPerInstruction(m) / s * 1e-9;
}

// The peak of `m` with `threads` threads, measured once per process (best of 5 short runs);
// 0 when the CPU lacks the mix.
double PeakGops(Mix m, int threads) {
  static std::map<std::pair<int, int>, double> cache;
  const std::pair<int, int> key{static_cast<int>(m), threads};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  double best = 0;
  if (MixSupported(m)) {
    CpuWorkerPool& pool = PoolForThreads(threads);
    for (int i = 0; i < 5; ++i) best = std::max(best, MeasurePeakGops(pool, m, 2'000'000));
  }
  cache[key] = best;
  return best;
}

void BM_Peak(benchmark::State& state, Mix m, int threads) {
  if (!MixSupported(m)) {
    state.SkipWithError(absl::StrCat(MixName(m), ": not supported by this CPU").c_str());
    return;
  }
  CpuWorkerPool& pool = PoolForThreads(threads);
  constexpr int64_t kIters = 4'000'000;
  double best = 0;
  for (auto _ : state) {
    std::vector<float> sink(pool.num_threads());
    const double s = TimedRun(pool, [&](int t) { sink[t] = RunPeakLoop(m, kIters); });
    g_peak_sink = g_peak_sink + sink[0];
    state.SetIterationTime(s);
    best = std::max(
        best, threads * static_cast<double>(kIters) * kPeakAcc * OpsPerInstruction(m) / s * 1e-9);
  }
  state.counters["Gops"] = best;
  state.counters["per_thread_Gops"] = best / threads;
  state.SetLabel(MixName(m));
}

// Every read kernel on its own cold buffer, and its fraction of the best of them in the same
// iteration (what "best read bandwidth" means in the GEMV cases).
void BM_ReadKernels(benchmark::State& state, int threads) {
  CpuWorkerPool& pool = PoolForThreads(threads);
  const HugeBuffer& buf = Fp8Rotation();
  constexpr size_t kChunk = size_t{32} << 20;
  const size_t chunks = buf.size() / kChunk;
  size_t i = 0;
  constexpr int kKernels = sizeof(kAllReadKernels) / sizeof(kAllReadKernels[0]);
  double sum[kKernels] = {}, frac[kKernels] = {};
  for (auto _ : state) {
    double gbps[kKernels], best = 0;
    for (int k = 0; k < kKernels; ++k) {
      gbps[k] = TimedReadKernelGBps(pool, kAllReadKernels[k], buf.data() + (i++ % chunks) * kChunk,
                                    kChunk);
      best = std::max(best, gbps[k]);
    }
    for (int k = 0; k < kKernels; ++k) {
      sum[k] += gbps[k];
      frac[k] += gbps[k] / best;
    }
    state.SetIterationTime(static_cast<double>(kChunk) / best * 1e-9);
  }
  const double iters = static_cast<double>(state.iterations());
  for (int k = 0; k < kKernels; ++k) {
    state.counters[absl::StrCat(ReadKernelName(kAllReadKernels[k]), "_GBps")] = sum[k] / iters;
    state.counters[absl::StrCat(ReadKernelName(kAllReadKernels[k]), "_frac")] = frac[k] / iters;
  }
}

void BM_ReadBandwidth(benchmark::State& state) {
  CpuWorkerPool& pool = PoolForThreads(static_cast<int>(state.range(0)));
  const HugeBuffer& buf = Fp8Rotation();
  constexpr size_t kChunk = size_t{64} << 20;
  const size_t chunks = buf.size() / kChunk;
  size_t i = 0;
  double gbps_sum = 0;
  for (auto _ : state) {
    const double gbps = TimedReadGBps(pool, buf.data() + (i++ % chunks) * kChunk, kChunk);
    state.SetIterationTime(static_cast<double>(kChunk) / gbps * 1e-9);
    gbps_sum += gbps;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kChunk));
  state.counters["GBps"] = gbps_sum / static_cast<double>(state.iterations());
}

// One FP8 GEMV case: isa, shape, tokens, threads, kernel options.
void BM_Fp8Gemv(benchmark::State& state, CpuIsa isa, Shape shape, int n, int threads,
                cpu::Fp8GemvOptions options) {
  auto gemv = cpu::NewFp8Gemv(isa, options);
  if (!gemv.ok()) {
    state.SkipWithError(gemv.status().ToString().c_str());
    return;
  }
  CpuWorkerPool& pool = PoolForThreads(threads);
  const Fp8Set& set = Fp8Matrices(shape);
  const PackedX x = PackRandom(**gemv, shape.cols, n);
  std::vector<float> y(n * shape.rows);
  const int64_t count = static_cast<int64_t>(set.views.size());
  const int64_t bytes = WeightBytes(set.views[0]);
  int64_t i = 0;
  double gemv_seconds = 0, read_seconds = 0, best_read_seconds = 0;
  // Fastest iteration of each: on a loaded machine most timings include a descheduling; the
  // fastest ones approximate the uncontended speeds (bw_frac_fastest).
  double fastest_gemv = 1e30, fastest_read = 1e30;
  for (auto _ : state) {
    // The adjacent bandwidth references: cold reads of two other matrices of the same size, once
    // STREAM-like and once as 8 prefetched streams (the better of the two is the "best" read).
    const size_t read_bytes = static_cast<size_t>(shape.rows * shape.cols) / 1024 * 1024;
    double gbps = 0, best_gbps = 0;
    int slot = 1;
    for (ReadKernel kernel : kAllReadKernels) {
      const auto* other =
          reinterpret_cast<const std::byte*>(set.views[(i + count * slot++ / 5) % count].data);
      const double g = TimedReadKernelGBps(pool, kernel, other, read_bytes);
      if (kernel == ReadKernel::kLinear) gbps = g;
      best_gbps = std::max(best_gbps, g);
    }
    read_seconds += static_cast<double>(bytes) / gbps * 1e-9;
    best_read_seconds += static_cast<double>(bytes) / best_gbps * 1e-9;
    fastest_read = std::min(fastest_read, static_cast<double>(bytes) / best_gbps * 1e-9);
    const double s = TimedGemv(pool, **gemv, set.views[i % count], x, n, y);
    benchmark::DoNotOptimize(y.data());
    state.SetIterationTime(s);
    gemv_seconds += s;
    fastest_gemv = std::min(fastest_gemv, s);
    ++i;
  }
  const double iters = static_cast<double>(state.iterations());
  state.counters["bw_frac_fastest"] = fastest_read / fastest_gemv;
  state.counters["fastest_GBps"] = bytes / fastest_gemv * 1e-9;
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["GBps"] = bytes * iters / gemv_seconds * 1e-9;
  state.counters["bw_GBps"] = bytes * iters / read_seconds * 1e-9;
  state.counters["bw_frac"] = read_seconds / gemv_seconds;
  state.counters["bw_best_GBps"] = bytes * iters / best_read_seconds * 1e-9;
  state.counters["bw_frac_best"] = best_read_seconds / gemv_seconds;
  // Compute side: multiply-adds actually applied (2 ops each) over the peak of the variant's
  // instruction mix on as many threads.
  const double gops = 2.0 * shape.rows * shape.cols * n * iters / gemv_seconds * 1e-9;
  const double peak = isa == CpuIsa::kScalar ? 0 : PeakGops(MixOf(isa), threads);
  state.counters["Gops"] = gops;
  if (peak > 0) state.counters["peak_frac"] = gops / peak;
  state.SetLabel(std::string(cpu::CpuIsaName(isa)));
}

// The kernel's own throughput, memory out of the way: one 128 x 7168 FP8 matrix (0.9 MiB) that
// stays in L2, read over and over. Above the read bandwidth means the variant can keep up with
// memory; below it, the expansion (not DRAM) bounds the cold GEMV.
// `down`: 512 rows of the down projection (2 KiB rows) instead of 128 rows of gate/up (7 KiB).
void BM_Fp8GemvL2(benchmark::State& state, CpuIsa isa, int n, bool down = false) {
  auto gemv = cpu::NewFp8Gemv(isa);
  if (!gemv.ok()) {
    state.SkipWithError(gemv.status().ToString().c_str());
    return;
  }
  const Fp8MatrixView w = down ? Fp8Matrices(kDown).views[0].RowSlice(0, 512)
                               : Fp8Matrices(kGateUp).views[0].RowSlice(0, 128);
  const PackedX x = PackRandom(**gemv, w.cols, n);
  std::vector<float> y(n * w.rows);
  for (auto _ : state) {
    for (int r = 0; r < 16; ++r) {
      (*gemv)->MatVec(w, x.data, x.stride, n, 0, w.rows, y.data(), w.rows);
      benchmark::DoNotOptimize(y.data());
    }
  }
  const double bytes = 16.0 * static_cast<double>(w.rows * w.cols);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["GBps"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(cpu::CpuIsaName(isa)));
}

// ------------------------------------------------------------------ baselines

#if HMOE_HAVE_OPENBLAS
// The paper's baseline: OpenBLAS sgemv on the FP32 dequantized copy (4 bytes per weight), timed
// next to the FP8 GEMV of the same matrix shape on the same number of threads.
void BM_Fp8VsOpenBlasSgemv(benchmark::State& state, Shape shape, int threads) {
  static std::unique_ptr<HugeBuffer> f32;
  static std::pair<int64_t, int64_t> f32_shape;
  const int64_t elements = shape.rows * shape.cols;
  const Fp8Set& set = Fp8Matrices(shape);
  const int64_t count = std::min<int64_t>(static_cast<int64_t>(set.views.size()),
                                          static_cast<int64_t>(kRotationBytes / (4 * elements)));
  if (f32 == nullptr) f32 = std::make_unique<HugeBuffer>(kRotationBytes);
  if (f32_shape != std::make_pair(shape.rows, shape.cols)) {
    for (int64_t i = 0; i < count; ++i) {
      const Fp8MatrixView& w = set.views[i];
      float* out = reinterpret_cast<float*>(f32->data()) + i * elements;
      for (int64_t r = 0; r < w.rows; ++r) {
        for (int64_t c = 0; c < w.cols; ++c) {
          out[r * w.cols + c] =
              kernels::DequantFp8Element(w.data[r * w.cols + c], w.scale_inv, w.scale_stride, r, c);
        }
      }
    }
    f32_shape = {shape.rows, shape.cols};
  }
  openblas_set_num_threads(threads);
  CpuWorkerPool& pool = PoolForThreads(threads);
  const Fp8Gemv& gemv = cpu::DefaultFp8Gemv();
  const PackedX x = PackRandom(gemv, shape.cols, 1);
  std::vector<float> xf(shape.cols, 0.5f), y(shape.rows);
  int64_t i = 0;
  double sgemv_seconds = 0, fp8_seconds = 0, read_seconds = 0;
  for (auto _ : state) {
    const float* a = reinterpret_cast<const float*>(f32->data()) + (i % count) * elements;
    const double gbps = TimedReadGBps(pool, f32->data() + ((i + count / 2) % count) * elements * 4,
                                      elements * 4 / 512 * 512);
    read_seconds += static_cast<double>(elements * 4) / gbps * 1e-9;
    fp8_seconds += TimedGemv(pool, gemv, set.views[(i * 7 + 3) % set.views.size()], x, 1, y);
    // OpenBLAS runs its own threads from this one; time it here.
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(shape.rows),
                static_cast<int>(shape.cols), 1.0f, a, static_cast<int>(shape.cols), xf.data(), 1,
                0.0f, y.data(), 1);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    benchmark::DoNotOptimize(y.data());
    state.SetIterationTime(s);
    sgemv_seconds += s;
    ++i;
  }
  const double iters = static_cast<double>(state.iterations());
  state.SetBytesProcessed(state.iterations() * elements * 4);
  state.counters["sgemv_ms"] = sgemv_seconds / iters * 1e3;
  state.counters["fp8_ms"] = fp8_seconds / iters * 1e3;
  state.counters["latency_ratio"] = sgemv_seconds / fp8_seconds;
  state.counters["GBps"] = elements * 4 * iters / sgemv_seconds * 1e-9;
  state.counters["bw_frac"] = read_seconds / sgemv_seconds;
  state.SetLabel("sgemv FP32 vs " + std::string(cpu::CpuIsaName(gemv.isa())));
}
#endif

// The naive alternative to the fused kernel: dequantize the FP8 rows to a BF16 matrix (scale
// applied), then run a BF16 GEMV over it. Needs AVX-512 F/BW.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void DequantRowsToBf16(
    const Fp8MatrixView& w, int64_t begin, int64_t end, uint16_t* out) {
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = w.data + r * w.row_stride;
    uint16_t* o = out + (r - begin) * w.cols;
    for (int64_t c = 0; c < w.cols; c += 16) {
      const float s = w.scale_inv[(r / 128) * w.scale_stride + c / 128] * 256.0f;
      const __m256i b =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
      const __m256i h =
          _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                          _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
      const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(s));
      __m512i u = _mm512_castps_si512(f);
      u = _mm512_add_epi32(
          u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                              _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    }
  }
}

// y[r] = sum_k bf16(W[r][k]) * x[k] with x split per 32 columns into [even 16][odd 16] floats.
__attribute__((target("avx512f,avx512bw"))) void Bf16Gemv(const uint16_t* w, int64_t rows,
                                                          int64_t cols, const float* x_split,
                                                          float* y) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t r = 0; r < rows; ++r) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    const uint16_t* row = w + r * cols;
    for (int64_t c = 0; c < cols; c += 32) {
      const __m512i v = _mm512_loadu_si512(row + c);
      acc0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                             _mm512_loadu_ps(x_split + c), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)),
                             _mm512_loadu_ps(x_split + c + 16), acc1);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, _mm512_add_ps(acc0, acc1));
    float sum = 0;
    for (float v : lanes) sum += v;
    y[r] = sum;
  }
}

void BM_Fp8VsDequantBf16(benchmark::State& state, Shape shape, int threads) {
  if (!__builtin_cpu_supports("avx512bw")) {
    state.SkipWithError("the dequantize-then-BF16 baseline needs AVX-512 BW");
    return;
  }
  CpuWorkerPool& pool = PoolForThreads(threads);
  const Fp8Gemv& gemv = cpu::DefaultFp8Gemv();
  const Fp8Set& set = Fp8Matrices(shape);
  const PackedX x = PackRandom(gemv, shape.cols, 1);
  std::vector<float> x_split(shape.cols, 0.25f), y(shape.rows);
  std::vector<uint16_t> scratch(shape.rows * shape.cols);
  const int64_t count = static_cast<int64_t>(set.views.size());
  int64_t i = 0;
  double base_seconds = 0, fp8_seconds = 0;
  for (auto _ : state) {
    fp8_seconds += TimedGemv(pool, gemv, set.views[i % count], x, 1, y);
    const Fp8MatrixView& w = set.views[(i + count / 2) % count];
    const double s = TimedRun(pool, [&](int t) {
      int64_t begin, end;
      SplitRows(w.rows, t, threads, &begin, &end);
      uint16_t* out = scratch.data() + begin * w.cols;
      DequantRowsToBf16(w, begin, end, out);
      Bf16Gemv(out, end - begin, w.cols, x_split.data(), y.data() + begin);
    });
    benchmark::DoNotOptimize(y.data());
    state.SetIterationTime(s);
    base_seconds += s;
    ++i;
  }
  const double iters = static_cast<double>(state.iterations());
  state.counters["baseline_ms"] = base_seconds / iters * 1e3;
  state.counters["fp8_ms"] = fp8_seconds / iters * 1e3;
  state.counters["latency_ratio"] = base_seconds / fp8_seconds;
  state.SetLabel("dequant->BF16 vs " + std::string(cpu::CpuIsaName(gemv.isa())));
}

// BF16 weights (lm_head, the router, BF16 checkpoints): finite random values, a cold rotation of
// its own so no case reads another's cached matrices.
struct Bf16Set {
  std::unique_ptr<HugeBuffer> buffer;
  std::vector<cpu::Bf16MatrixView> views;
};

const Bf16Set& Bf16Matrices(const Shape& shape) {
  static std::map<std::pair<int64_t, int64_t>, Bf16Set> sets;
  Bf16Set& set = sets[{shape.rows, shape.cols}];
  if (set.views.empty()) {
    set.buffer = std::make_unique<HugeBuffer>(kRotationBytes);
    auto* w = reinterpret_cast<uint16_t*>(set.buffer->data());
    const size_t n = set.buffer->size() / 2;
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> dist(-0.05f, 0.05f);
    for (size_t i = 0; i < n; ++i) w[i] = kernels::FloatToBf16Bits(dist(rng));
    const int64_t bytes = 2 * shape.rows * shape.cols;
    for (int64_t off = 0; off + bytes <= static_cast<int64_t>(set.buffer->size()); off += bytes) {
      set.views.push_back({set.buffer->data() + off, shape.rows, shape.cols, shape.cols});
    }
  }
  return set;
}

// One BF16 GEMV case (one token), with the best read of two other cold matrices of the same size
// in the same iteration as the yardstick (as BM_Fp8Gemv).
void BM_Bf16Gemv(benchmark::State& state, CpuIsa isa, Shape shape, int threads) {
  auto gemv = cpu::NewBf16Gemv(isa);
  if (!gemv.ok()) {
    state.SkipWithError(gemv.status().ToString().c_str());
    return;
  }
  CpuWorkerPool& pool = PoolForThreads(threads);
  const Bf16Set& set = Bf16Matrices(shape);
  std::vector<float> xf(shape.cols, 0.5f);
  std::vector<std::byte> packed(cpu::Bf16Gemv::PackedBytes(shape.cols));
  cpu::Bf16Gemv::Pack(xf.data(), shape.cols, packed.data());
  std::vector<float> y(shape.rows);
  const int64_t count = static_cast<int64_t>(set.views.size());
  const int64_t bytes = 2 * shape.rows * shape.cols;
  double gemv_seconds = 0, best_read_seconds = 0;
  int64_t i = 0;
  for (auto _ : state) {
    double best_gbps = 0;
    int slot = 1;
    for (ReadKernel kernel : kAllReadKernels) {
      const std::byte* other = set.views[(i + count * slot++ / 5) % count].data;
      best_gbps = std::max(best_gbps, TimedReadKernelGBps(pool, kernel, other, bytes));
    }
    best_read_seconds += static_cast<double>(bytes) / best_gbps * 1e-9;
    const cpu::Bf16MatrixView& w = set.views[i % count];
    const double s = TimedRun(pool, [&](int t) {
      int64_t begin, end;
      SplitRows(w.rows, t, threads, &begin, &end);
      (*gemv)->MatVec(w, packed.data(), 0, 1, begin, end, y.data() + begin, 0);
    });
    benchmark::DoNotOptimize(y.data());
    state.SetIterationTime(s);
    gemv_seconds += s;
    ++i;
  }
  const double iters = static_cast<double>(state.iterations());
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["GBps"] = bytes * iters / gemv_seconds * 1e-9;
  state.counters["bw_best_GBps"] = bytes * iters / best_read_seconds * 1e-9;
  state.counters["bw_frac_best"] = best_read_seconds / gemv_seconds;
  state.SetLabel(std::string(cpu::CpuIsaName(isa)));
}

std::string ShapeName(const Shape& s) { return absl::StrCat(s.name, "/", s.rows, "x", s.cols); }

void RegisterAll() {
  for (int threads : {1, 2}) {
    benchmark::RegisterBenchmark(absl::StrCat("BM_ReadBandwidth/threads:", threads).c_str(),
                                 BM_ReadBandwidth)
        ->Arg(threads)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (Mix m : kAllMixes) {
    for (int threads : {1, 2}) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Peak/", MixName(m), "/threads:", threads).c_str(),
          [=](benchmark::State& s) { BM_Peak(s, m, threads); })
          ->UseManualTime()
          ->Iterations(5)
          ->Unit(benchmark::kMillisecond);
    }
  }
  for (int threads : {1, 2}) {
    benchmark::RegisterBenchmark(absl::StrCat("BM_ReadKernels/threads:", threads).c_str(),
                                 [=](benchmark::State& s) { BM_ReadKernels(s, threads); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  const CpuIsa best = cpu::BestCpuIsa();
  // The acceptance cases: best variant, one token, expert shapes, 1 and 2 threads.
  for (const Shape& shape : {kGateUp, kDown, kKimiQb, kKimiO}) {
    for (int threads : {1, 2}) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Fp8Gemv/", ShapeName(shape), "/n:1/threads:", threads).c_str(),
          [=](benchmark::State& s) { BM_Fp8Gemv(s, best, shape, 1, threads, {}); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  // Small-batch GEMM (decode batches) and the other variants.
  for (int n : {2, 4, 6, 8}) {
    for (int threads : {1, 2}) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Fp8Gemv/", ShapeName(kGateUp), "/n:", n, "/threads:", threads).c_str(),
          [=](benchmark::State& s) { BM_Fp8Gemv(s, best, kGateUp, n, threads, {}); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  // Every variant this CPU runs (the acceptance of issue 15: each at memory speed for 1-2 tokens
  // on the expert shapes), e.g. BM_Fp8Gemv_avx2/... forced on an AVX-512 machine.
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16, CpuIsa::kAmx}) {
    if (!cpu::CpuSupports(isa)) continue;
    for (const Shape& shape : {kGateUp, kDown}) {
      for (int n : {1, 2, 4, 6, 8}) {
        for (int threads : {1, 2}) {
          benchmark::RegisterBenchmark(
              absl::StrCat("BM_Fp8Gemv_", std::string(cpu::CpuIsaName(isa)), "/", ShapeName(shape),
                           "/n:", n, "/threads:", threads)
                  .c_str(),
              [=](benchmark::State& s) { BM_Fp8Gemv(s, isa, shape, n, threads, {}); })
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16, CpuIsa::kAmx}) {
    if (!cpu::CpuSupports(isa)) continue;
    for (int n : {1, 2, 6, 8}) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Fp8GemvL2_", std::string(cpu::CpuIsaName(isa)), "/128x7168/n:", n)
              .c_str(),
          [=](benchmark::State& s) { BM_Fp8GemvL2(s, isa, n); })
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Fp8GemvL2_", std::string(cpu::CpuIsaName(isa)), "/512x2048/n:", n)
              .c_str(),
          [=](benchmark::State& s) { BM_Fp8GemvL2(s, isa, n, true); })
          ->Unit(benchmark::kMillisecond);
    }
  }
  // Prefetch tuning: distance (bytes beyond the next tile of rows; 0 = no software prefetch)
  // with the default instruction (prefetcht1), per row and as one linear stream; then the other
  // instructions at the default distance.
  struct Tuning {
    std::string name;
    cpu::Fp8GemvOptions options;
  };
  std::vector<Tuning> tunings;
  for (bool linear : {false, true}) {
    for (int64_t pf : {0, 512, 1024, 2048, 4096, 8192}) {
      if (linear && pf == 0) continue;
      cpu::Fp8GemvOptions o;
      o.prefetch_bytes = pf;
      o.prefetch_linear = linear;
      tunings.push_back({absl::StrCat("prefetch:", pf, linear ? "/linear" : ""), o});
    }
  }
  for (int hint : {0, 2}) {
    cpu::Fp8GemvOptions o;
    o.prefetch_hint = hint;
    tunings.push_back({hint == 0 ? "hint:t0" : "hint:nta", o});
  }
  {
    cpu::Fp8GemvOptions o;
    o.prefetch = false;
    tunings.push_back({"no_prefetch", o});
  }
  for (const Shape& shape : {kGateUp, kDown}) {
    for (const Tuning& tuning : tunings) {
      for (int threads : {1, 2}) {
        const cpu::Fp8GemvOptions o = tuning.options;
        benchmark::RegisterBenchmark(
            absl::StrCat("BM_Fp8GemvPrefetch/", ShapeName(shape), "/", tuning.name,
                         "/threads:", threads)
                .c_str(),
            [=](benchmark::State& s) { BM_Fp8Gemv(s, best, shape, 1, threads, o); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  for (const Shape& shape : {kGateUp, kDown}) {
    for (int threads : {1, 2}) {
#if HMOE_HAVE_OPENBLAS
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Fp8VsOpenBlasSgemv/", ShapeName(shape), "/threads:", threads).c_str(),
          [=](benchmark::State& s) { BM_Fp8VsOpenBlasSgemv(s, shape, threads); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
#endif
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Fp8VsDequantBf16/", ShapeName(shape), "/threads:", threads).c_str(),
          [=](benchmark::State& s) { BM_Fp8VsDequantBf16(s, shape, threads); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  // BF16 GEMV at the `real-shaped` lm_head (vocabulary 4096 x hidden 7168), every variant.
  constexpr Shape kHead = {4096, 7168, "lm_head"};
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    for (int threads : {1, 2}) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Bf16Gemv_", std::string(cpu::CpuIsaName(isa)), "/", ShapeName(kHead),
                       "/threads:", threads)
              .c_str(),
          [=](benchmark::State& s) { BM_Bf16Gemv(s, isa, kHead, threads); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  RegisterMoeLayerBenchmarks();
}

}  // namespace
}  // namespace hmoe::bench

int main(int argc, char** argv) {
  // OpenBLAS's idle threads spin for a long time by default and would steal the second vCPU from
  // the next FP8 case; the variable is read when the library loads, so re-exec once with it set.
  if (std::getenv("OPENBLAS_THREAD_TIMEOUT") == nullptr) {
    setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1);
    execv("/proc/self/exe", argv);  // on failure, carry on as we are
  }
  benchmark::Initialize(&argc, argv);
  // What the figures were measured on: the CPU model and the FP8 kernels the dispatcher picks.
  std::string model = "unknown";
  if (FILE* f = std::fopen("/proc/cpuinfo", "r")) {
    char line[512];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      if (std::strncmp(line, "model name", 10) == 0) {
        const char* colon = std::strchr(line, ':');
        if (colon != nullptr) model = std::string(colon + 2, std::strcspn(colon + 2, "\n"));
        break;
      }
    }
    std::fclose(f);
  }
  benchmark::AddCustomContext("cpu_model", model);
  benchmark::AddCustomContext("cpu_kernels_dispatched",
                              std::string(hmoe::cpu::CpuIsaName(hmoe::cpu::BestCpuIsa())));
  hmoe::bench::RegisterAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

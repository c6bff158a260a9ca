// FP8 GEMM (issue #15): Fp8Gemm against the GEMV's GemmRows on the same rows, for M tokens, with
// every case given as a fraction of a register-only peak of its instruction mix measured in the
// same run (bench_util's peak loops: vdpbf16ps for the AVX-512 BF16 variant, F32 FMA on zmm / ymm
// for the others).
// FLOPs are 2 per weight multiply applied (rows * cols * M * 2). Weights are one matrix reused
// across iterations (a compute-bound kernel from 16 tokens on; the GEMV's cold-weight speed is
// hmoe_kernels_bench's subject).
//
//   hmoe_gemm_bench [--benchmark_filter=...]       (HMOE_CPU_ISA=avx2 forces a variant)
//   smoke: hmoe_gemm_bench --benchmark_filter='expert_gate/m:64/threads:1'
//   --benchmark_min_time=0.01

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <benchmark/benchmark.h>

#include "common/base/logging.h"
#include "common/kernels/cpu/f32_ops.h"
#include "common/kernels/cpu/fp8_gemm.h"
#include "common/kernels/cpu/fp8_gemv.h"
#include "tests/bench/bench_util.h"

namespace hmoe::bench {
namespace {

using cpu::CpuIsa;

// ----------------------------------------------------------------------- register-only peaks

constexpr int64_t kPeakIters = 1 << 20;

volatile float g_sink = 0;

// CPU time of the calling thread, in seconds: on a shared machine, the compute rate of a core while
// it ran (wall-clock rates also count the time other processes held it).
double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// GFLOP/s of one core for the instruction mix `isa`'s GEMM uses (2 FLOPs per multiply): the best of
// 3 runs of bench_util's peak loop, timed by the thread's CPU clock (see ThreadCpuSeconds).
double PeakGflops(CpuIsa isa) {
  if (isa == CpuIsa::kScalar) return 0;
  const Mix mix = MixOf(isa);
  const double flops_per_iter = kPeakAcc * OpsPerInstruction(mix);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = ThreadCpuSeconds();
    g_sink = g_sink + RunPeakLoop(mix, kPeakIters);
    best = std::max(best, flops_per_iter * kPeakIters / (ThreadCpuSeconds() - t0) * 1e-9);
  }
  return best;
}

// ----------------------------------------------------------------------- cases

struct Shape {
  int64_t rows, cols;
  const char* name;
};

constexpr Shape kShapes[] = {
    {2048, 7168, "expert_gate"},  // routed expert gate/up
    {7168, 2048, "expert_down"}, {1536, 7168, "q_a"},        {24576, 1536, "q_b"},
    {7168, 16384, "o_proj"},     {256, 1024, "l2_resident"},  // weights stay in L2: the kernel
                                                              // without memory stalls
};

struct Matrix {
  std::vector<uint8_t> w;
  std::vector<float> scales;
  cpu::Fp8MatrixView view;
};

Matrix MakeMatrix(const Shape& s) {
  Matrix m;
  m.w.resize(s.rows * s.cols);
  FillRandomFp8(reinterpret_cast<std::byte*>(m.w.data()), m.w.size(), 7);
  m.scales.assign(((s.rows + 127) / 128) * ((s.cols + 127) / 128), 1e-3f);
  m.view = cpu::Fp8MatrixView::Dense(m.w.data(), m.scales.data(), s.rows, s.cols);
  return m;
}

struct AlignedFree {
  void operator()(std::byte* p) const { std::free(p); }
};

// kind 0: Fp8Gemm; 1: the GEMV's GemmRows (MatVec for m <= 8).
void BM_Gemm(benchmark::State& state, Shape shape, int kind) {
  const int64_t m = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  CpuWorkerPool& pool = PoolForThreads(threads);
  const Matrix w = MakeMatrix(shape);
  std::vector<float> x(m * shape.cols);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (float& v : x) v = dist(rng);
  std::vector<float> y(m * shape.rows);
  const cpu::Fp8Gemm& gemm = cpu::DefaultFp8Gemm();
  const cpu::Fp8Gemv& gemv = cpu::DefaultFp8Gemv();
  const int64_t packed_stride = gemv.PackedBytes(shape.cols);
  const int64_t packed_bytes = kind == 0 ? gemm.PackedBytes(m, shape.cols) : packed_stride * m;
  std::unique_ptr<std::byte, AlignedFree> packed(
      static_cast<std::byte*>(std::aligned_alloc(64, (packed_bytes + 63) / 64 * 64)));
  const int64_t tiles = (m + gemm.TokenTile() - 1) / gemm.TokenTile();
  // The peak measured right before and after the case (the better of the two): on a shared
  // machine the core's speed drifts with its neighbours' load.
  double peak_per_core = PeakGflops(kind == 0 ? gemm.isa() : gemv.isa());
  double seconds = 0;
  std::vector<double> cpu_seconds(threads);  // per thread, summed over iterations
  for (auto _ : state) {
    seconds += TimedRun(pool, [&](int t) {
      if (kind == 0) {
        const int64_t t0 = tiles * t / threads * gemm.TokenTile();
        const int64_t t1 = std::min(m, tiles * (t + 1) / threads * gemm.TokenTile());
        if (t0 < t1) gemm.Pack(x.data(), shape.cols, m, shape.cols, t0, t1, packed.get());
      } else {
        for (int64_t i = m * t / threads; i < m * (t + 1) / threads; ++i) {
          gemv.Pack(x.data() + i * shape.cols, shape.cols, 0, shape.cols,
                    packed.get() + i * packed_stride);
        }
      }
    });
    seconds += TimedRun(pool, [&](int t) {
      const double c0 = ThreadCpuSeconds();
      int64_t r0, r1;
      SplitRows(shape.rows, t, threads, &r0, &r1);
      if (kind == 0) {
        gemm.Multiply(w.view, packed.get(), m, r0, r1, y.data() + r0, shape.rows);
      } else if (m <= cpu::kMaxMatVecTokens) {
        gemv.MatVec(w.view, packed.get(), packed_stride, static_cast<int>(m), r0, r1, y.data() + r0,
                    shape.rows);
      } else {
        gemv.GemmRows(w.view, packed.get(), packed_stride, m, r0, r1, y.data() + r0, shape.rows);
      }
      cpu_seconds[t] += ThreadCpuSeconds() - c0;
    });
  }
  const double flops = 2.0 * shape.rows * shape.cols * m * state.iterations();
  const CpuIsa isa = kind == 0 ? gemm.isa() : gemv.isa();
  state.counters["gflops"] = flops / seconds * 1e-9;
  state.counters["tok_per_s"] = m * state.iterations() / seconds;
  peak_per_core = std::max(peak_per_core, PeakGflops(isa));
  const double peak = peak_per_core * threads;
  state.counters["peak_gflops"] = peak;
  state.counters["peak_frac"] = peak > 0 ? flops / seconds * 1e-9 / peak : 0;
  // The multiply alone per core-second of CPU time (the slowest thread), against the CPU-time peak.
  const double cpu = *std::max_element(cpu_seconds.begin(), cpu_seconds.end());
  state.counters["cpu_peak_frac"] = peak > 0 ? flops / cpu * 1e-9 / peak : 0;
  state.SetLabel(absl::StrCat(kind == 0 ? "gemm " : "gemv ", std::string(cpu::CpuIsaName(isa))));
}

void BM_Peak(benchmark::State& state, CpuIsa isa) {
  for (auto _ : state) state.counters["gflops_per_core"] = PeakGflops(isa);
  state.SetLabel(std::string(cpu::CpuIsaName(isa)));
}

// The MLA attention's P V update (common/device/cpu_mla.cc) for 4 query rows over one 16-key
// tile of 576-float cache rows into 512-float accumulators: one Axpy4F32 per key (before) or one
// AxpyTile4F32 (after), bitwise the same result. GFLOP per CPU-second over the F32 FMA peak of
// the F32 ops' variant (`HMOE_CPU_ISA=avx2` for the AVX2 one), measured in the same case.
void BM_AttentionPv(benchmark::State& state) {
  const bool tile = state.range(0) != 0;
  constexpr int64_t kRank = 512, kRow = 576, kKeys = 16, kReps = 4096;
  std::vector<float> cache(kKeys * kRow), acc(4 * kRank, 0.0f), p(4 * kKeys);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (float& v : cache) v = d(rng);
  for (float& v : p) v = 1e-6f * d(rng);  // keeps acc bounded over the repetitions
  const float* keys[kKeys];
  for (int64_t j = 0; j < kKeys; ++j) keys[j] = cache.data() + j * kRow;
  double cpu = 0;
  for (auto _ : state) {
    const double c0 = ThreadCpuSeconds();
    for (int64_t rep = 0; rep < kReps; ++rep) {
      if (tile) {
        cpu::AxpyTile4F32(p.data(), kKeys, keys, kKeys, acc.data(), kRank, kRank);
      } else {
        for (int64_t j = 0; j < kKeys; ++j) {
          const float a[4] = {p[j], p[kKeys + j], p[2 * kKeys + j], p[3 * kKeys + j]};
          cpu::Axpy4F32(a, keys[j], acc.data(), kRank, kRank);
        }
      }
    }
    cpu += ThreadCpuSeconds() - c0;
    benchmark::DoNotOptimize(acc.data());
  }
  const CpuIsa isa = cpu::F32OpsIsa();
  const Mix mix = isa == CpuIsa::kAvx512 ? Mix::kF32FmaAvx512 : Mix::kF32FmaAvx2;
  double peak = 0;
  for (int rep = 0; rep < 3 && isa != CpuIsa::kScalar; ++rep) {
    const double t0 = ThreadCpuSeconds();
    g_sink = g_sink + RunPeakLoop(mix, kPeakIters);
    peak = std::max(
        peak, kPeakAcc * OpsPerInstruction(mix) * kPeakIters / (ThreadCpuSeconds() - t0) * 1e-9);
  }
  const double gflops = 2.0 * 4 * kKeys * kRank * kReps * state.iterations() / cpu * 1e-9;
  state.counters["gflops_per_cpu_s"] = gflops;
  state.counters["peak_gflops"] = peak;
  state.counters["peak_frac"] = peak > 0 ? gflops / peak : 0;
  state.SetLabel(absl::StrCat(tile ? "AxpyTile4F32 " : "Axpy4F32 per key ",
                              std::string(cpu::CpuIsaName(isa))));
}

void Register() {
  benchmark::RegisterBenchmark("BM_AttentionPv", BM_AttentionPv)
      ->ArgName("tile")
      ->Arg(0)
      ->Arg(1)
      ->Unit(benchmark::kMillisecond);
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    if (!cpu::CpuSupports(isa)) continue;
    benchmark::RegisterBenchmark(
        absl::StrCat("BM_Peak/", std::string(cpu::CpuIsaName(isa))).c_str(), BM_Peak, isa)
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  }
  for (const Shape& s : kShapes) {
    for (int kind : {0, 1}) {
      auto* b = benchmark::RegisterBenchmark(
          absl::StrCat("BM_", kind == 0 ? "Fp8Gemm/" : "Fp8GemvRows/", s.name).c_str(), BM_Gemm, s,
          kind);
      b->ArgNames({"m", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
      for (int threads : {1, 2}) {
        for (int64_t m : {1, 4, 8, 12, 16, 24, 32, 64, 128, 512}) b->Args({m, threads});
      }
    }
  }
}

}  // namespace
}  // namespace hmoe::bench

int main(int argc, char** argv) {
  hmoe::bench::Register();
  benchmark::Initialize(&argc, argv);
  std::fprintf(stderr, "cpu variant: gemm %s, gemv %s\n",
               std::string(hmoe::cpu::CpuIsaName(hmoe::cpu::DefaultFp8Gemm().isa())).c_str(),
               std::string(hmoe::cpu::CpuIsaName(hmoe::cpu::DefaultFp8Gemv().isa())).c_str());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

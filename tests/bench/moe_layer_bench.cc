// Whole-MoE-layer benchmark (issue #7): 8 routed experts per token out of a pool of cold experts
// plus 1 shared expert, DeepSeek-V3 / Kimi-K2 shapes (hidden 7168, expert intermediate 2048),
// through MoeExecutor (thread pool, per-expert barriers, two global barriers per layer). Each
// iteration also reads two 128 MiB cold buffers for the adjacent bandwidth (STREAM-like, and as 8
// prefetched streams); bw_frac = layer GB/s of expert weights over the STREAM-like read,
// bw_frac_best over the better of the two. ms_per_unique_expert shows that batches cost what their
// distinct experts cost.

#include "tests/bench/moe_layer_bench.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <benchmark/benchmark.h>

#include "common/base/logging.h"
#include "common/kernels/cpu/fp8_gemv.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "common/ops/cpu/moe_executor.h"
#include "tests/bench/bench_util.h"

namespace hmoe::bench {
namespace {

constexpr int64_t kHidden = 7168;
constexpr int64_t kInter = 2048;
// Routing picks among 256 expert ids (DeepSeek-V3 / Kimi-K2 have 256 / 384), backed by 64
// physical experts (2.8 GB); a batch never uses two ids backed by the same bytes, so every expert
// a layer runs is read cold.
constexpr int kPoolExperts = 64;
constexpr int kExpertIds = 256;
constexpr int kTopK = 8;
constexpr int64_t kMatrixBytes = kHidden * kInter;
constexpr int64_t kScalesPerMatrix = (kHidden / 128) * (kInter / 128);

struct ExpertStore {
  std::unique_ptr<HugeBuffer> bytes;  // (kPoolExperts + 1) experts x 3 matrices
  std::vector<float> scales;
  std::vector<cpu::Fp8MatrixView> gate, up, down;  // whole experts; the last one is shared
};

const ExpertStore& Store() {
  static ExpertStore* store = [] {
    auto* s = new ExpertStore;
    const int experts = kPoolExperts + 1;
    s->bytes = std::make_unique<HugeBuffer>(static_cast<size_t>(experts) * 3 * kMatrixBytes);
    FillRandomFp8(s->bytes->data(), s->bytes->size(), 11);
    s->scales.resize(static_cast<size_t>(experts) * 3 * kScalesPerMatrix);
    std::mt19937 rng(12);
    std::uniform_real_distribution<float> dist(1e-4f, 4e-3f);
    for (float& v : s->scales) v = dist(rng);
    for (int e = 0; e < experts; ++e) {
      auto matrix = [&](int i, int64_t rows, int64_t cols) {
        const int64_t index = e * 3 + i;
        return cpu::Fp8MatrixView::Dense(
            reinterpret_cast<const uint8_t*>(s->bytes->data()) + index * kMatrixBytes,
            s->scales.data() + index * kScalesPerMatrix, rows, cols);
      };
      s->gate.push_back(matrix(0, kInter, kHidden));
      s->up.push_back(matrix(1, kInter, kHidden));
      s->down.push_back(matrix(2, kHidden, kInter));
    }
    return s;
  }();
  return *store;
}

HugeBuffer& ReadBuffer() {
  static HugeBuffer* buffer = new HugeBuffer(size_t{768} << 20);
  return *buffer;
}

MoeLayerWeights LayerFor(int nodes) {
  const ExpertStore& s = Store();
  MoeLayerWeights layer;
  layer.hidden = kHidden;
  for (int id = 0; id < kExpertIds; ++id) {
    const int e = id % kPoolExperts;
    auto split = SplitExpert(s.gate[e], s.up[e], s.down[e], nodes);
    HMOE_CHECK_OK(split.status());
    layer.routed.push_back(*std::move(split));
  }
  auto shared = SplitExpert(s.gate[kPoolExperts], s.up[kPoolExperts], s.down[kPoolExperts], nodes);
  HMOE_CHECK_OK(shared.status());
  layer.shared.push_back(*std::move(shared));
  return layer;
}

void BM_MoeLayer(benchmark::State& state, int batch, int nodes, int threads_per_node) {
  CpuWorkerPoolOptions pool_options;
  pool_options.num_nodes = nodes;
  pool_options.threads_per_node = threads_per_node;
  auto pool = CpuWorkerPool::Create(pool_options);
  HMOE_CHECK_OK(pool.status());
  auto executor = MoeExecutor::Create(pool->get(), &cpu::DefaultFp8Gemv(), kHidden, {});
  HMOE_CHECK_OK(executor.status());
  const MoeLayerWeights layer = LayerFor(nodes);
  std::mt19937 rng(batch);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(batch * kHidden), out(x.size());
  for (float& v : x) v = normal(rng);
  std::vector<int32_t> ids(batch * kTopK);
  std::uniform_int_distribution<int32_t> pick(0, kExpertIds - 1);
  std::vector<float> weights(ids.size(), 2.5f / kTopK);
  const HugeBuffer& read = ReadBuffer();
  constexpr size_t kReadChunk = size_t{128} << 20;
  int64_t iteration = 0, experts = 0, bytes = 0;
  double seconds = 0, read_seconds_per_byte = 0, best_read_seconds_per_byte = 0;
  for (auto _ : state) {
    // Uniform routing (distinct ids per token), re-drawn when an id would share its bytes with
    // another id of the batch.
    std::vector<int32_t> owner(kPoolExperts, -1);
    for (int t = 0; t < batch; ++t) {
      for (int j = 0; j < kTopK; ++j) {
        while (true) {
          const int32_t id = pick(rng);
          int32_t& o = owner[id % kPoolExperts];
          if (o != -1 && o != id) continue;
          if (std::find(ids.begin() + t * kTopK, ids.begin() + t * kTopK + j, id) !=
              ids.begin() + t * kTopK + j) {
            continue;
          }
          o = id;
          ids[t * kTopK + j] = id;
          break;
        }
      }
    }
    const size_t chunks = read.size() / kReadChunk;
    const double gbps =
        TimedReadGBps(**pool, read.data() + (iteration % chunks) * kReadChunk, kReadChunk);
    const double streams_gbps = TimedReadStreamsGBps(
        **pool, read.data() + ((iteration + 2) % chunks) * kReadChunk, kReadChunk);
    ++iteration;
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status s = (*executor)->Forward(layer, x, {kTopK, ids, weights}, out);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    HMOE_CHECK_OK(s);
    benchmark::DoNotOptimize(out.data());
    state.SetIterationTime(sec);
    seconds += sec;
    experts += (*executor)->last_active_experts();
    bytes += (*executor)->last_weight_bytes();
    read_seconds_per_byte += 1.0 / (gbps * 1e9);
    best_read_seconds_per_byte += 1.0 / (std::max(gbps, streams_gbps) * 1e9);
  }
  const double iters = static_cast<double>(state.iterations());
  const double layer_gbps = static_cast<double>(bytes) / seconds * 1e-9;
  const double bw_gbps = iters / read_seconds_per_byte * 1e-9;
  state.SetBytesProcessed(bytes);
  state.counters["ms"] = seconds / iters * 1e3;
  state.counters["weight_MB"] = static_cast<double>(bytes) / iters * 1e-6;
  state.counters["unique_experts"] = static_cast<double>(experts) / iters;
  state.counters["ms_per_unique_expert"] = seconds / static_cast<double>(experts) * 1e3;
  state.counters["GBps"] = layer_gbps;
  state.counters["bw_GBps"] = bw_gbps;
  state.counters["bw_frac"] = layer_gbps / bw_gbps;
  const double best_gbps = iters / best_read_seconds_per_byte * 1e-9;
  state.counters["bw_best_GBps"] = best_gbps;
  state.counters["bw_frac_best"] = layer_gbps / best_gbps;
  state.SetLabel(std::string(cpu::CpuIsaName(cpu::DefaultFp8Gemv().isa())));
}

}  // namespace

void RegisterMoeLayerBenchmarks() {
  struct Config {
    int nodes;
    int threads_per_node;
  };
  for (const Config c : {Config{1, 1}, Config{1, 2}, Config{2, 1}}) {
    for (int batch : {1, 2, 4, 6}) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_MoeLayer/batch:", batch, "/nodes:", c.nodes,
                       "/threads:", c.nodes * c.threads_per_node)
              .c_str(),
          [=](benchmark::State& s) { BM_MoeLayer(s, batch, c.nodes, c.threads_per_node); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace hmoe::bench

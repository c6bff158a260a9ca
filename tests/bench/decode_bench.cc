// Decode throughput of the engine (issue #8, acceptance 4 and 5) on the `real-shaped` checkpoint:
// CPU attention (CpuDevice) + CPU MoE, all weights FP8 (lm_head BF16), batch 1, 2, 4 and 6, with 1
// and 2 threads. Each figure is also given as a fraction of the memory-bandwidth bound: the
// weight bytes one decode step reads divided by the read bandwidth measured adjacent to the run
// (same pool, same thread count: a 256 MiB read right before every step, averaged; this
// machine's bandwidth is bimodal with 2 threads and drifts with other processes' load, so only
// an adjacent measurement is a fair yardstick). read_GBps_around is the best of 3 x 1 GiB reads
// before and after the run.
//
//   hmoe-make-model --preset real-shaped --out /work/main/out/real-shaped
//   HMOE_BENCH_MODEL=/work/main/out/real-shaped decode_bench   (or --model=DIR)
//   decode_bench --model=DIR --prefill=4096 --benchmark_filter=Prefill   (prefill timing, e.g. on
//   the `small` checkpoint)
//   decode_bench --model=DIR --prefill=512 --step-tokens=512 --benchmark_filter=Prefill
//     (one 512-token chunk; --gemm-min-tokens=N sets CpuDeviceOptions::fp8_gemm_min_tokens, e.g.
//     a huge N for the GEMV-only baseline in the same binary; it sets only this bench's device:
//     the engine's host device, which runs the CPU experts, keeps the default)
//   ... --profile: also the prefill's time and GFLOP per op class (bench::ProfilingDevice); the
//     prefill rows print frac_of_peak (GFLOP per CPU-second over the register-only peak of the
//     GEMM's instruction mix measured in the same run)
//
// A GGUF model (--model=FILE.gguf, e.g. `hmoe-make-model --preset small --format gguf --quant
// q4_k_m`) runs the same BM_Decode / BM_Prefill (not the step-runner cases, whose byte count is
// FP8's); its products with block-type weights follow HMOE_QUANT_ACTIVATIONS (q8k by default,
// f32 for the dequantize-then-F32 path: run the binary once with each), printed as the label,
// and the bytes of a step are the GGUF tensors' own. A GGUF BM_Prefill's frac_of_peak is over the
// int8 dot-product peak of the quantized kernels' variant (vpdpbusd zmm, or ymm under
// HMOE_CPU_ISA=avx2); HMOE_QUANT_GEMM=0 runs GemmRows without the GEMM kernels (before/after).
//
// Weights are copied once into transparent-huge-page memory, as weightd holds them (pass
// --in_place to read the checkpoint's page-cache mapping instead). Without a model the benchmark
// prints a note and exits 0.

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <benchmark/benchmark.h>

#include "common/base/logging.h"
#include "common/device/cpu_device.h"
#include "common/engine/engine.h"
#include "common/engine/kv_cache.h"
#include "common/engine/weights.h"
#include "common/kernels/cpu/fp8_gemm.h"
#include "common/kernels/cpu/quant_gemv.h"
#include "common/model/checkpoint.h"
#include "common/model/gguf_source.h"
#include "common/model/tensor_map.h"
#include "decode_worker/forward_pass_step_engine.h"
#include "decode_worker/step_runner.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/profiling_device.h"

namespace hmoe {
namespace {

std::string g_model_dir;
bool g_in_place = false;
int g_steps = 24;
int64_t g_step_tokens = 64;      // EngineOptions::max_step_tokens
int64_t g_gemm_min_tokens = -1;  // CpuDeviceOptions::fp8_gemm_min_tokens
// --profile: BM_Prefill runs the experts on the engine's device (ExpertPlacement::kDevice: the
// same grouped path and kernels as the host device) wrapped in a bench::ProfilingDevice, and
// prints the time per op class.
bool g_profile = false;

// Every tensor of a WeightSource copied into one huge-page buffer (as weightd lays them out).
class HugePageWeights final : public WeightSource {
 public:
  explicit HugePageWeights(const WeightSource& source) {
    size_t total = 0;
    const std::vector<std::string> names = source.TensorNames();
    for (const std::string& name : names) {
      total += (source.GetTensor(name)->size_bytes + 63) / 64 * 64;
    }
    buffer_ = std::make_unique<bench::HugeBuffer>(total);
    size_t offset = 0;
    for (const std::string& name : names) {
      TensorView t = *source.GetTensor(name);
      std::memcpy(buffer_->data() + offset, t.data, t.size_bytes);
      t.data = buffer_->data() + offset;
      offset += (t.size_bytes + 63) / 64 * 64;
      tensors_[name] = t;
    }
  }
  absl::StatusOr<TensorView> GetTensor(const std::string& name) const override {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) return absl::NotFoundError(name);
    return it->second;
  }
  std::vector<std::string> TensorNames() const override {
    std::vector<std::string> names;
    for (const auto& [name, t] : tensors_) names.push_back(name);
    return names;
  }

 private:
  std::unique_ptr<bench::HugeBuffer> buffer_;
  std::map<std::string, TensorView> tensors_;
};

int64_t Fp8Bytes(int64_t rows, int64_t cols) {
  return rows * cols + ((rows + 127) / 128) * ((cols + 127) / 128) * 4;
}

// Weight bytes of one decode step outside the routed/shared experts: every attention module,
// router, dense MLP, norms and lm_head (the embedding row is negligible).
int64_t NonExpertBytesPerStep(const ModelConfig& c) {
  const int64_t h = c.hidden_size, nh = c.num_attention_heads;
  int64_t bytes = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const int64_t rq = c.q_lora_rank.value_or(0);
    bytes += rq > 0 ? Fp8Bytes(rq, h) + Fp8Bytes(nh * c.qk_head_dim(), rq) + rq * 2
                    : Fp8Bytes(nh * c.qk_head_dim(), h);
    bytes += Fp8Bytes(c.kv_lora_rank + c.qk_rope_head_dim, h) + c.kv_lora_rank * 2;
    // kv_b: W_UV read in place, W_UK read as its transposed copy (same size).
    bytes += Fp8Bytes(nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
    bytes += Fp8Bytes(h, nh * c.v_head_dim);
    bytes += 2 * h * 2;  // two norms
    if (c.is_moe_layer(l)) {
      bytes += c.n_routed_experts * h * 2 + c.n_routed_experts * 4;
    } else {
      bytes += 2 * Fp8Bytes(c.intermediate_size, h) + Fp8Bytes(h, c.intermediate_size);
    }
  }
  bytes += c.vocab_size * h * 2 + h * 2;
  return bytes;
}

// The bytes of every tensor a decode step reads in full (all but the routed and shared experts
// and the embedding table) of a GGUF model, as stored.
int64_t GgufNonExpertBytes(const WeightSource& source) {
  int64_t bytes = 0;
  for (const std::string& name : source.TensorNames()) {
    if (name.find(".mlp.experts.") != std::string::npos ||
        name.find(".mlp.shared_experts.") != std::string::npos || name == kEmbedTokensName) {
      continue;
    }
    bytes += static_cast<int64_t>(source.GetTensor(name)->size_bytes);
  }
  return bytes;
}

struct Setup {
  std::unique_ptr<WeightSource> checkpoint;  // a Checkpoint or a GgufCheckpoint
  ModelConfig config;
  bool gguf = false;
  int64_t gguf_non_expert_bytes = 0;
  std::unique_ptr<HugePageWeights> copy;
  std::unique_ptr<bench::HugeBuffer> probe;  // for the adjacent bandwidth measurement
  std::map<int, std::unique_ptr<Device>> devices;
  std::map<int, std::unique_ptr<ResidentWeights>> weights;
  std::map<int, std::unique_ptr<Engine>> engines;
  std::map<int, std::unique_ptr<KvCache>> caches;
  // The decode worker's own step path (ForwardPassStepEngine + StepRunner), for dual batch on/off.
  std::map<int, std::unique_ptr<Device>> step_devices;
  std::map<int, std::unique_ptr<decode::ForwardPassStepEngine>> step_engines;
};

// Expert bytes the step engines' MoE layers read, counted from their routing (every MoE layer of
// every micro-batch reports the experts its tokens chose: those experts' bytes, once each, plus
// the shared experts).
std::atomic<int64_t> g_step_expert_bytes{0};

Setup& GetSetup() {
  static Setup* const setup = [] {
    auto* s = new Setup();
    if (IsGgufPath(g_model_dir)) {
      auto gguf = GgufCheckpoint::Open(g_model_dir);
      HMOE_CHECK_OK(gguf.status());
      s->config = (*gguf)->config();
      s->gguf = true;
      s->gguf_non_expert_bytes = GgufNonExpertBytes(**gguf);
      s->checkpoint = std::move(*gguf);
    } else {
      auto checkpoint = Checkpoint::Open(g_model_dir);
      HMOE_CHECK_OK(checkpoint.status());
      s->config = (*checkpoint)->config();
      s->checkpoint = std::move(*checkpoint);
    }
    if (!g_in_place) s->copy = std::make_unique<HugePageWeights>(*s->checkpoint);
    s->probe = std::make_unique<bench::HugeBuffer>(size_t{1} << 30);
    return s;
  }();
  return *setup;
}

Engine& EngineForThreads(int threads) {
  Setup& s = GetSetup();
  if (s.engines.count(threads) == 0) {
    CpuWorkerPool& pool = bench::PoolForThreads(threads);
    CpuDeviceOptions device_options;
    device_options.pool = &pool;
    device_options.fp8_gemm_min_tokens = g_gemm_min_tokens;
    s.devices[threads] = NewCpuDevice(device_options);
    if (g_profile) {
      s.devices[threads] =
          std::make_unique<bench::ProfilingDevice>(std::move(s.devices[threads]), s.config);
    }
    const WeightSource& source =
        s.copy != nullptr ? static_cast<const WeightSource&>(*s.copy) : *s.checkpoint;
    ResidentWeightsOptions weight_options;
    weight_options.moe_parts = pool.num_nodes();
    auto weights = ResidentWeights::Create(s.config, source, *s.devices[threads], weight_options);
    HMOE_CHECK_OK(weights.status());
    s.weights[threads] = std::move(*weights);
    EngineOptions options;
    options.max_step_tokens = g_step_tokens;
    if (g_profile) options.experts = ExpertPlacement::kDevice;
    auto engine = Engine::Create(s.config, *s.weights[threads], *s.devices[threads], pool, options);
    HMOE_CHECK_OK(engine.status());
    s.engines[threads] = std::move(*engine);
    auto cache = KvCache::Create(*s.devices[threads], KvCacheConfig::ForModel(s.config, 64, 64));
    HMOE_CHECK_OK(cache.status());
    s.caches[threads] = std::move(*cache);
  }
  return *s.engines[threads];
}

decode::ForwardPassStepEngine& StepEngineForThreads(int threads) {
  Setup& s = GetSetup();
  if (s.step_engines.count(threads) == 0) {
    CpuWorkerPool& pool = bench::PoolForThreads(threads);
    CpuDeviceOptions device_options;
    device_options.pool = &pool;
    s.step_devices[threads] = NewCpuDevice(device_options);
    const WeightSource& source =
        s.copy != nullptr ? static_cast<const WeightSource&>(*s.copy) : *s.checkpoint;
    const ModelConfig& c = s.config;
    const int64_t h = c.hidden_size;
    const int64_t expert_bytes =
        2 * Fp8Bytes(c.moe_intermediate_size, h) + Fp8Bytes(h, c.moe_intermediate_size);
    const int64_t shared_bytes = c.n_shared_experts * expert_bytes;
    decode::ForwardPassStepEngineOptions options;
    options.max_step_tokens = 64;
    options.max_step_sequences = 8;
    options.kv_blocks = 64;
    options.kv_block_tokens = 64;
    options.engine.routing_observer = [expert_bytes, shared_bytes](
                                          int64_t, int64_t n, int64_t top_k, const int32_t* ids) {
      std::vector<int32_t> distinct(ids, ids + n * top_k);
      std::sort(distinct.begin(), distinct.end());
      const int64_t unique = std::unique(distinct.begin(), distinct.end()) - distinct.begin();
      // Relaxed: a counter read after the step's threads have synchronized with this one.
      g_step_expert_bytes.fetch_add(unique * expert_bytes + shared_bytes,
                                    std::memory_order_relaxed);
    };
    auto engine =
        decode::ForwardPassStepEngine::Create(c, source, *s.step_devices[threads], pool, options);
    HMOE_CHECK_OK(engine.status());
    s.step_engines[threads] = std::move(*engine);
  }
  return *s.step_engines[threads];
}

double AdjacentBandwidth(int threads) {
  Setup& s = GetSetup();
  CpuWorkerPool& pool = bench::PoolForThreads(threads);
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    best = std::max(best, bench::TimedReadGBps(pool, s.probe->data(), s.probe->size()));
  }
  return best;
}

void BM_Decode(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int batch = static_cast<int>(state.range(1));
  Engine& engine = EngineForThreads(threads);
  KvCache& cache = *GetSetup().caches[threads];
  const ModelConfig& c = engine.config();

  // Sequences with short prompts of different lengths (prefill outside the timed region).
  std::vector<KvSequence> seqs;
  std::vector<int32_t> next(batch);
  for (int b = 0; b < batch; ++b) {
    seqs.push_back(cache.NewSequence());
    std::vector<int32_t> prompt(8 + 3 * b);
    for (size_t i = 0; i < prompt.size(); ++i)
      prompt[i] = static_cast<int32_t>((b * 131 + i * 17) % 4000);
    SequenceInput in{&seqs[b], prompt, true};
    auto out = engine.Forward(std::span<const SequenceInput>(&in, 1));
    HMOE_CHECK_OK(out.status());
    next[b] = static_cast<int32_t>(std::max_element((*out)[0].begin(), (*out)[0].end()) -
                                   (*out)[0].begin());
  }
  std::vector<SequenceInput> inputs(batch);
  const double bw_before = AdjacentBandwidth(threads);

  int64_t steps = 0;
  int64_t expert_bytes = 0;
  double seconds = 0;
  StepStats phases;
  // A 256 MiB read with the same pool right before every step: the bandwidth the step could get
  // at that moment (this machine's bandwidth drifts with the load of other processes).
  CpuWorkerPool& pool = bench::PoolForThreads(threads);
  const std::byte* probe = GetSetup().probe->data();
  double probe_sum = 0;
  for (auto _ : state) {
    probe_sum +=
        bench::TimedReadGBps(pool, probe + (steps % 4) * (size_t{256} << 20), size_t{256} << 20);
    for (int b = 0; b < batch; ++b) {
      inputs[b] = {&seqs[b], std::span<const int32_t>(&next[b], 1), true};
    }
    const auto start = std::chrono::steady_clock::now();
    auto out = engine.Forward(inputs);
    const auto end = std::chrono::steady_clock::now();
    HMOE_CHECK_OK(out.status());
    seconds += std::chrono::duration<double>(end - start).count();
    state.SetIterationTime(std::chrono::duration<double>(end - start).count());
    const StepStats& st = engine.last_step_stats();
    expert_bytes += st.expert_weight_bytes;
    phases.attention_seconds += st.attention_seconds;
    phases.ffn_seconds += st.ffn_seconds;
    phases.head_seconds += st.head_seconds;
    ++steps;
    for (int b = 0; b < batch; ++b) {
      next[b] = static_cast<int32_t>(std::max_element((*out)[b].begin(), (*out)[b].end()) -
                                     (*out)[b].begin());
    }
  }
  const double bw_after = AdjacentBandwidth(threads);
  // The yardstick: the mean of the per-step probes (before/after figures are reported too).
  const double bandwidth = probe_sum / std::max<int64_t>(1, steps);
  const double step_seconds = seconds / std::max<int64_t>(1, steps);
  const Setup& setup = GetSetup();
  const double bytes_per_step =
      static_cast<double>(setup.gguf ? setup.gguf_non_expert_bytes : NonExpertBytesPerStep(c)) +
      static_cast<double>(expert_bytes) / steps;
  if (setup.gguf) {
    state.SetLabel(absl::StrCat("gguf, activations ",
                                cpu::QuantActivationsName(cpu::DefaultQuantActivations())));
  }
  state.counters["tok_per_s"] = batch / step_seconds;
  state.counters["ms_per_step"] = step_seconds * 1e3;
  state.counters["GB_per_step"] = bytes_per_step * 1e-9;
  state.counters["eff_GBps"] = bytes_per_step / step_seconds * 1e-9;
  state.counters["read_GBps"] = bandwidth;
  state.counters["read_GBps_around"] = std::max(bw_before, bw_after);
  state.counters["frac_of_bw"] = bytes_per_step / step_seconds * 1e-9 / bandwidth;
  state.counters["attn_ms"] = phases.attention_seconds / steps * 1e3;
  state.counters["ffn_ms"] = phases.ffn_seconds / steps * 1e3;
  state.counters["head_ms"] = phases.head_seconds / steps * 1e3;
}

// Decode steps through the decode worker's StepRunner, as one batch or as two overlapped
// micro-batches (dual batch, paper §3.3.1): tokens/s and the fraction of the bandwidth bound,
// with the bytes counted per micro-batch (each reads the experts its own tokens chose).
void BM_DecodeStepRunner(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int batch = static_cast<int>(state.range(1));
  const bool dual = state.range(2) != 0;
  decode::ForwardPassStepEngine& engine = StepEngineForThreads(threads);
  const ModelConfig& c = engine.engine().config();
  auto runner = decode::StepRunner::Create(engine, dual);
  HMOE_CHECK_OK(runner.status());
  std::vector<std::unique_ptr<decode::StepSequence>> seqs;
  std::vector<int32_t> next(batch);
  std::vector<std::vector<int32_t>> prompts(batch);
  for (int b = 0; b < batch; ++b) {
    auto seq = engine.NewSequence(64 + 8 + 3 * b + g_steps);
    HMOE_CHECK_OK(seq.status());
    seqs.push_back(std::move(*seq));
    for (int i = 0; i < 8 + 3 * b; ++i) {
      prompts[b].push_back(static_cast<int32_t>((b * 131 + i * 17) % 4000));
    }
    decode::StepInput in{seqs[b].get(), prompts[b], true};
    std::vector<decode::StepResult> out =
        (*runner)->Run(std::span<const decode::StepInput>(&in, 1));
    HMOE_CHECK_OK(out[0].status);
    next[b] = static_cast<int32_t>(std::max_element(out[0].logits.begin(), out[0].logits.end()) -
                                   out[0].logits.begin());
  }
  std::vector<decode::StepInput> inputs(batch);
  CpuWorkerPool& pool = bench::PoolForThreads(threads);
  const std::byte* probe = GetSetup().probe->data();
  double probe_sum = 0;
  double seconds = 0;
  int64_t steps = 0;
  g_step_expert_bytes.store(0, std::memory_order_relaxed);
  for (auto _ : state) {
    probe_sum +=
        bench::TimedReadGBps(pool, probe + (steps % 4) * (size_t{256} << 20), size_t{256} << 20);
    for (int b = 0; b < batch; ++b) {
      inputs[b] = {seqs[b].get(), std::span<const int32_t>(&next[b], 1), true};
    }
    const auto start = std::chrono::steady_clock::now();
    std::vector<decode::StepResult> out = (*runner)->Run(inputs);
    const auto end = std::chrono::steady_clock::now();
    seconds += std::chrono::duration<double>(end - start).count();
    state.SetIterationTime(std::chrono::duration<double>(end - start).count());
    for (int b = 0; b < batch; ++b) {
      HMOE_CHECK_OK(out[b].status);
      next[b] = static_cast<int32_t>(std::max_element(out[b].logits.begin(), out[b].logits.end()) -
                                     out[b].logits.begin());
    }
    ++steps;
  }
  const double bandwidth = probe_sum / std::max<int64_t>(1, steps);
  const double step_seconds = seconds / std::max<int64_t>(1, steps);
  // Non-expert weights are read once per micro-batch.
  const int64_t passes = (dual && batch >= 2) ? 2 : 1;
  const double bytes_per_step =
      static_cast<double>(passes * NonExpertBytesPerStep(c)) +
      static_cast<double>(g_step_expert_bytes.load(std::memory_order_relaxed)) / steps;
  state.counters["tok_per_s"] = batch / step_seconds;
  state.counters["ms_per_step"] = step_seconds * 1e3;
  state.counters["GB_per_step"] = bytes_per_step * 1e-9;
  state.counters["read_GBps"] = bandwidth;
  state.counters["frac_of_bw"] = bytes_per_step / step_seconds * 1e-9 / bandwidth;
  state.counters["dual_steps"] = (*runner)->last_split().dual ? 1 : 0;
}

// FLOPs (2 per weight multiply applied) of a prefill of `length` tokens from an empty cache in
// chunks of `chunk`: projections, absorbed MLA attention (W_UK^T q, scores over the latent and
// rope parts, the latent sum, W_UV), the dense MLP or the routed + shared experts and their
// router, and the head for the last token only.
double PrefillFlops(const ModelConfig& c, int64_t length) {
  const double h = static_cast<double>(c.hidden_size);
  const double nh = static_cast<double>(c.num_attention_heads);
  const double rq = static_cast<double>(c.q_lora_rank.value_or(0));
  const double rkv = static_cast<double>(c.kv_lora_rank);
  const double dq = static_cast<double>(c.qk_head_dim());
  // Keys seen: token i (0-based) sees i + 1 keys, whatever the chunking.
  const double keys = static_cast<double>(length) * (length + 1) / 2;
  double per_token = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    per_token += rq > 0 ? h * rq + rq * nh * dq : h * nh * dq;
    per_token += h * (rkv + c.qk_rope_head_dim);
    per_token += nh * c.v_head_dim * h;
    per_token += nh * 2 * rkv * c.qk_nope_head_dim;  // W_UK^T q and W_UV u per head
    if (c.is_moe_layer(l)) {
      per_token += 3.0 * h * c.moe_intermediate_size *
                   static_cast<double>(c.num_experts_per_tok + c.n_shared_experts);
      per_token += h * c.n_routed_experts;
    } else {
      per_token += 3.0 * h * c.intermediate_size;
    }
  }
  const double attention =
      static_cast<double>(c.num_hidden_layers) * nh * keys * (2 * rkv + c.qk_rope_head_dim);
  return 2.0 * (per_token * length + attention + h * c.vocab_size);
}

// The register-only peak (GFLOP per CPU-second of the calling thread) of `mix`, best of 3.
double CpuPeakGflops(bench::Mix mix) {
  if (!bench::MixSupported(mix)) return 0;
  constexpr int64_t kIters = 1 << 20;
  static volatile float sink = 0;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = bench::ThreadCpuSeconds();
    sink = sink + bench::RunPeakLoop(mix, kIters);
    const double t = bench::ThreadCpuSeconds() - t0;
    best = std::max(best, bench::kPeakAcc * bench::OpsPerInstruction(mix) * kIters / t * 1e-9);
  }
  return best;
}

double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Prefill of one prompt of state.range(1) tokens from an empty cache (Engine::Forward splits it
// into steps of max_step_tokens); reports tokens/s and the device's peak scratch + KV bytes.
void BM_Prefill(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int64_t length = state.range(1);
  Engine& engine = EngineForThreads(threads);
  Device& device = engine.device();
  const ModelConfig& c = engine.config();
  const int64_t block = 64;
  auto cache = KvCache::Create(device, KvCacheConfig::ForModel(c, (length + block) / block, block));
  HMOE_CHECK_OK(cache.status());
  std::vector<int32_t> prompt(length);
  for (int64_t i = 0; i < length; ++i) prompt[i] = static_cast<int32_t>((i * 7919) % 3000);
  auto* profiler = dynamic_cast<bench::ProfilingDevice*>(&device);
  if (profiler != nullptr) {
    profiler->Reset();
    profiler->set_step_tokens(std::min(length, g_step_tokens));
  }
  // The peak of the GEMM's instruction mix, by the main thread's CPU clock, right before and
  // after the prefill (the larger is used: load only lowers it).
  // A GGUF model's products run on the quantized kernels (int8 dot products): the int8 peak of
  // their variant (AVX-512 VNNI: vpdpbusd zmm; AVX2: the core's 256-bit vpdpbusd where it has
  // AVX-VNNI, else the FP32 FMA peak as a stand-in).
  const bench::Mix mix = GetSetup().gguf ? bench::Int8MixOf(cpu::DefaultQuantGemv().isa())
                                         : bench::MixOf(cpu::DefaultFp8Gemm().isa());
  double peak = CpuPeakGflops(mix);
  double seconds = 0;
  double cpu_seconds = 0;
  double process_cpu_seconds = 0;
  for (auto _ : state) {
    KvSequence seq = (*cache)->NewSequence();
    device.ResetPeakBytes();
    SequenceInput in{&seq, prompt, true};
    const double cpu0 = bench::ThreadCpuSeconds();
    const double process0 = ProcessCpuSeconds();
    const auto start = std::chrono::steady_clock::now();
    auto out = engine.Forward(std::span<const SequenceInput>(&in, 1));
    const auto end = std::chrono::steady_clock::now();
    cpu_seconds += bench::ThreadCpuSeconds() - cpu0;
    process_cpu_seconds += ProcessCpuSeconds() - process0;
    HMOE_CHECK_OK(out.status());
    seconds += std::chrono::duration<double>(end - start).count();
    state.SetIterationTime(std::chrono::duration<double>(end - start).count());
  }
  state.counters["tok_per_s"] = static_cast<double>(length) * state.iterations() / seconds;
  // The main thread's CPU time: with other processes on the cores, what it computed per second
  // it ran (with 2 threads it does about half of the work).
  state.counters["main_cpu_s"] = cpu_seconds / state.iterations();
  // Every thread's CPU time (the pool's threads spin briefly at barriers: counted, as lost work).
  state.counters["process_cpu_s"] = process_cpu_seconds / state.iterations();
  peak = std::max(peak, CpuPeakGflops(mix));
  const double flops = PrefillFlops(engine.config(), length) * state.iterations();
  state.counters["peak_gflops_per_core"] = peak;
  state.SetLabel(bench::MixName(mix));
  // GFLOP per CPU-second of all threads over the per-core peak: the fraction of the peak the
  // cores reached while they ran this prefill (acceptance 2 of issue 15).
  state.counters["frac_of_peak"] = flops / process_cpu_seconds * 1e-9 / peak;
  state.counters["GFLOP_per_cpu_s"] = flops / process_cpu_seconds * 1e-9;
  if (profiler != nullptr) {
    double wall = 0, cpu = 0, op_flops = 0;
    for (const auto& [what, t] : profiler->times()) {
      wall += t.wall_s;
      cpu += t.cpu_s;
      op_flops += t.flops;
    }
    std::printf("prefill of %lld tokens, %d thread(s): %.2f s wall, %.2f s main-thread CPU\n",
                static_cast<long long>(length), threads, seconds, cpu_seconds);
    std::printf("%-28s %8s %7s %8s %7s %9s %10s\n", "op class", "wall s", "wall %", "cpu s",
                "cpu %", "GFLOP", "GFLOP/cpu-s");
    for (const auto& [what, t] : profiler->times()) {
      std::printf("%-28s %8.3f %6.1f%% %8.3f %6.1f%% %9.1f %10.1f\n", what.c_str(), t.wall_s,
                  100 * t.wall_s / seconds, t.cpu_s, 100 * t.cpu_s / cpu_seconds, t.flops * 1e-9,
                  t.cpu_s > 0 ? t.flops * 1e-9 / t.cpu_s : 0.0);
    }
    std::printf("%-28s %8.3f %6.1f%% %8.3f %6.1f%% %9.1f\n", "(outside device ops)", seconds - wall,
                100 * (seconds - wall) / seconds, cpu_seconds - cpu,
                100 * (cpu_seconds - cpu) / cpu_seconds, 0.0);
    std::printf("(device ops counted %.1f GFLOP; the model count is %.1f)\n", op_flops * 1e-9,
                PrefillFlops(engine.config(), length) * 1e-9);
  }
  state.counters["device_peak_MB"] = static_cast<double>(device.peak_bytes_in_use()) * 1e-6;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) {
  // Our flags first (Google Benchmark rejects unknown ones).
  std::vector<char*> rest;
  std::vector<int64_t> prefill_lengths;  // --prefill=N (repeatable): also time an N-token prefill
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--model=", 0) == 0) {
      hmoe::g_model_dir = arg.substr(8);
    } else if (arg == "--in_place") {
      hmoe::g_in_place = true;
    } else if (arg.rfind("--prefill=", 0) == 0) {
      prefill_lengths.push_back(std::atoll(arg.c_str() + 10));
    } else if (arg.rfind("--steps=", 0) == 0) {
      hmoe::g_steps = std::atoi(arg.c_str() + 8);
    } else if (arg.rfind("--step-tokens=", 0) == 0) {
      hmoe::g_step_tokens = std::atoll(arg.c_str() + 14);
    } else if (arg == "--profile") {
      hmoe::g_profile = true;
    } else if (arg.rfind("--gemm-min-tokens=", 0) == 0) {
      hmoe::g_gemm_min_tokens = std::atoll(arg.c_str() + 18);
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (hmoe::g_model_dir.empty()) {
    const char* env = std::getenv("HMOE_BENCH_MODEL");
    if (env != nullptr) hmoe::g_model_dir = env;
  }
  const bool gguf = hmoe::IsGgufPath(hmoe::g_model_dir);
  if (hmoe::g_model_dir.empty() ||
      !std::ifstream(gguf ? hmoe::g_model_dir : hmoe::g_model_dir + "/config.json").good()) {
    std::printf(
        "decode_bench: no model (set HMOE_BENCH_MODEL or --model=DIR to a real-shaped "
        "checkpoint); skipping\n");
    return 0;
  }
  for (int threads : {1, 2}) {
    for (int batch : {1, 2, 4, 6}) {
      benchmark::RegisterBenchmark("BM_Decode", hmoe::BM_Decode)
          ->Args({threads, batch})
          ->ArgNames({"threads", "batch"})
          ->Iterations(hmoe::g_steps)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  for (int threads : {1, 2}) {
    for (int batch : {1, 2, 4, 6}) {
      if (gguf) break;  // the step runner's byte count is FP8's
      for (int dual : {0, 1}) {
        benchmark::RegisterBenchmark("BM_DecodeStepRunner", hmoe::BM_DecodeStepRunner)
            ->Args({threads, batch, dual})
            ->ArgNames({"threads", "batch", "dual"})
            ->Iterations(hmoe::g_steps)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  for (int64_t length : prefill_lengths) {
    for (int threads : {1, 2}) {
      benchmark::RegisterBenchmark("BM_Prefill", hmoe::BM_Prefill)
          ->Args({threads, length})
          ->ArgNames({"threads", "tokens"})
          ->Iterations(1)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

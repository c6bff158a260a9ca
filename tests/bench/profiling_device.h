// A Device that forwards every call to another one and accumulates, per op class, the wall time
// and the main thread's CPU time of the calls (CpuDevice ops are synchronous, so the time of a
// call is the time of the op). Linear calls are classed by the weight's shape and the number of
// tokens (DeepSeek-V3 shapes: q_a, q_b, kv_a, o_proj, dense MLP, experts, head), so a prefill's
// time splits into the items of issue #15 without a sampling profiler (this VM has no perf
// counters, and valgrind does not run AVX-512). Bench-only: not thread-safe across callers.

#ifndef HMOE_TESTS_BENCH_PROFILING_DEVICE_H_
#define HMOE_TESTS_BENCH_PROFILING_DEVICE_H_

#include <time.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "common/device/device.h"
#include "common/model/model_config.h"

namespace hmoe::bench {

// CPU time of the calling thread.
inline double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct OpTime {
  double wall_s = 0;
  double cpu_s = 0;
  int64_t calls = 0;
  double flops = 0;  // 2 per weight multiply applied (Linear and attention only)
};

class ProfilingDevice final : public Device {
 public:
  ProfilingDevice(std::unique_ptr<Device> inner, const ModelConfig& config)
      : inner_(std::move(inner)), c_(config) {}

  Device& inner() { return *inner_; }
  const std::map<std::string, OpTime>& times() const { return times_; }
  void Reset() { times_.clear(); }

  DeviceKind kind() const override { return inner_->kind(); }
  std::string name() const override { return inner_->name(); }
  bool host_accessible() const override { return inner_->host_accessible(); }
  absl::StatusOr<DeviceBuffer> Allocate(size_t size_bytes) override {
    return inner_->Allocate(size_bytes);
  }
  absl::StatusOr<DeviceBuffer> AllocateBlocking(size_t size_bytes, absl::Time deadline) override {
    return inner_->AllocateBlocking(size_bytes, deadline);
  }
  size_t bytes_in_use() const override { return inner_->bytes_in_use(); }
  size_t peak_bytes_in_use() const override { return inner_->peak_bytes_in_use(); }
  void ResetPeakBytes() override { inner_->ResetPeakBytes(); }
  size_t budget_bytes() const override { return inner_->budget_bytes(); }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override { return inner_->CreateStream(); }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override { return inner_->CreateEvent(); }
  absl::Status Synchronize() override { return inner_->Synchronize(); }
  absl::Status CopyToDevice(Stream& s, void* dst, const void* src, size_t bytes) override {
    return Time("copies", 0, [&] { return inner_->CopyToDevice(s, dst, src, bytes); });
  }
  absl::Status CopyToHost(Stream& s, void* dst, const void* src, size_t bytes) override {
    return Time("copies", 0, [&] { return inner_->CopyToHost(s, dst, src, bytes); });
  }
  absl::Status CopyOnDevice(Stream& s, void* dst, const void* src, size_t bytes) override {
    return Time("copies", 0, [&] { return inner_->CopyOnDevice(s, dst, src, bytes); });
  }
  absl::Status Memset(Stream& s, void* dst, int value, size_t bytes) override {
    return Time("copies", 0, [&] { return inner_->Memset(s, dst, value, bytes); });
  }
  absl::Status Linear(Stream& s, const LinearWeight& w, const float* x, int64_t x_stride, int64_t n,
                      float* y, int64_t y_stride) override {
    return Time(LinearClass(w, n), 2.0 * static_cast<double>(w.rows) * w.cols * n,
                [&] { return inner_->Linear(s, w, x, x_stride, n, y, y_stride); });
  }
  absl::Status RmsNorm(Stream& s, const float* x, int64_t x_stride, int64_t n, int64_t dim,
                       const VectorWeight& weight, float eps, float* y, int64_t y_stride) override {
    return Time("norms, rope, silu, add", 0,
                [&] { return inner_->RmsNorm(s, x, x_stride, n, dim, weight, eps, y, y_stride); });
  }
  absl::Status RopeInterleaved(Stream& s, float* x, int64_t x_stride, int64_t n, int64_t num_heads,
                               int64_t head_stride, int64_t rope_dim, const int32_t* positions,
                               const float* inv_freq, float attention_factor) override {
    return Time("norms, rope, silu, add", 0, [&] {
      return inner_->RopeInterleaved(s, x, x_stride, n, num_heads, head_stride, rope_dim, positions,
                                     inv_freq, attention_factor);
    });
  }
  absl::Status SiluMul(Stream& s, const float* gate, const float* up, int64_t count,
                       float* out) override {
    return Time("norms, rope, silu, add", 0,
                [&] { return inner_->SiluMul(s, gate, up, count, out); });
  }
  absl::Status Add(Stream& s, const float* a, const float* b, int64_t count, float* out) override {
    return Time("norms, rope, silu, add", 0, [&] { return inner_->Add(s, a, b, count, out); });
  }
  absl::Status EmbeddingGather(Stream& s, const LinearWeight& table, const int32_t* ids, int64_t n,
                               float* out) override {
    return Time("copies", 0, [&] { return inner_->EmbeddingGather(s, table, ids, n, out); });
  }
  absl::Status MoeGate(Stream& s, const float* x, int64_t x_stride, int64_t n,
                       const LinearWeight& router, const VectorWeight& bias,
                       const MoeGateParams& params, int32_t* ids, float* weights) override {
    return Time("moe gate (router)", 2.0 * static_cast<double>(router.rows) * router.cols * n, [&] {
      return inner_->MoeGate(s, x, x_stride, n, router, bias, params, ids, weights);
    });
  }
  absl::Status KvCacheWrite(Stream& s, const KvLayerView& cache, const int32_t* slots, int64_t n,
                            const float* latent, int64_t latent_stride, const float* k_pe,
                            int64_t k_pe_stride, int64_t kv_lora_rank) override {
    return Time("copies", 0, [&] {
      return inner_->KvCacheWrite(s, cache, slots, n, latent, latent_stride, k_pe, k_pe_stride,
                                  kv_lora_rank);
    });
  }
  absl::Status MlaDecodeAttention(Stream& s, const MlaAttentionArgs& args) override {
    return Time("mla attention", AttentionFlops(args),
                [&] { return inner_->MlaDecodeAttention(s, args); });
  }
  absl::Status MlaPrefillAttention(Stream& s, const MlaAttentionArgs& args) override {
    return Time("mla attention", AttentionFlops(args),
                [&] { return inner_->MlaPrefillAttention(s, args); });
  }
  absl::Status MlaAttentionPartial(Stream& s, const MlaAttentionArgs& args,
                                   const MlaPartialState& state) override {
    return Time("mla attention", AttentionFlops(args),
                [&] { return inner_->MlaAttentionPartial(s, args, state); });
  }
  absl::Status MlaProjectLatent(Stream& s, const MlaDimensions& dims, const LinearWeight& kv_b,
                                const float* u, int64_t n, float* out,
                                int64_t out_stride) override {
    return Time("mla attention", 0,
                [&] { return inner_->MlaProjectLatent(s, dims, kv_b, u, n, out, out_stride); });
  }
  absl::Status GatherRows(Stream& s, const float* src, int64_t src_stride, const int32_t* rows,
                          int64_t n, int64_t cols, float* dst, int64_t dst_stride) override {
    return Time("copies", 0, [&] {
      return inner_->GatherRows(s, src, src_stride, rows, n, cols, dst, dst_stride);
    });
  }
  absl::Status ScatterAddRows(Stream& s, const float* src, int64_t src_stride, const int32_t* rows,
                              const float* weights, int64_t n, int64_t cols, float* dst,
                              int64_t dst_stride) override {
    return Time("moe scatter-add", 0, [&] {
      return inner_->ScatterAddRows(s, src, src_stride, rows, weights, n, cols, dst, dst_stride);
    });
  }

 private:
  template <typename F>
  absl::Status Time(const std::string& what, double flops, F&& f) {
    const double cpu0 = ThreadCpuSeconds();
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = f();
    const auto t1 = std::chrono::steady_clock::now();
    OpTime& t = times_[what];
    t.wall_s += std::chrono::duration<double>(t1 - t0).count();
    t.cpu_s += ThreadCpuSeconds() - cpu0;
    t.flops += flops;
    ++t.calls;
    return s;
  }

  // Multiplies of the absorbed attention: per (row, head) W_UK^T q, a score per visible key over
  // kv_lora_rank + rope_dim, the latent sum over kv_lora_rank, and W_UV u.
  static double AttentionFlops(const MlaAttentionArgs& a) {
    const MlaDimensions& d = a.dims;
    double keys = 0;
    for (const MlaSegment& s : a.segments) {
      // Rows start_pos .. start_pos + num_queries - 1 see start_pos + i + 1 keys.
      keys += static_cast<double>(s.num_queries) * s.start_pos +
              static_cast<double>(s.num_queries) * (s.num_queries + 1) / 2;
    }
    double rows = 0;
    for (const MlaSegment& s : a.segments) rows += static_cast<double>(s.num_queries);
    const double per_key = static_cast<double>(2 * d.kv_lora_rank + d.rope_dim);
    const double per_row = 2.0 * static_cast<double>(d.kv_lora_rank) * d.nope_dim;
    return 2.0 * d.num_heads * (keys * per_key + rows * per_row);
  }

  std::string LinearClass(const LinearWeight& w, int64_t n) const {
    const int64_t h = c_.hidden_size;
    if (w.cols == h && w.rows == c_.q_lora_rank.value_or(-1)) return "q_a";
    if (w.cols == c_.q_lora_rank.value_or(-1)) return "q_b";
    if (w.cols == h && w.rows == c_.kv_lora_rank + c_.qk_rope_head_dim) return "kv_a";
    if (w.rows == h && w.cols == c_.num_attention_heads * c_.v_head_dim) return "o_proj";
    if ((w.cols == h && w.rows == c_.intermediate_size) ||
        (w.rows == h && w.cols == c_.intermediate_size)) {
      return "dense mlp";
    }
    if ((w.cols == h && w.rows == c_.moe_intermediate_size) ||
        (w.rows == h && w.cols == c_.moe_intermediate_size)) {
      return n == tokens_ ? "shared expert (all tokens)" : "routed experts";
    }
    if (w.cols == h && w.rows == c_.vocab_size) return "head";
    return "other linear";
  }

 public:
  // The step's token count: an expert Linear over exactly this many rows is taken for the shared
  // expert (a routed expert with every token of the step is counted with it).
  void set_step_tokens(int64_t n) { tokens_ = n; }

 private:
  std::unique_ptr<Device> inner_;
  ModelConfig c_;
  int64_t tokens_ = -1;
  std::map<std::string, OpTime> times_;
};

}  // namespace hmoe::bench

#endif  // HMOE_TESTS_BENCH_PROFILING_DEVICE_H_

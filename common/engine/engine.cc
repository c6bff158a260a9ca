#include "common/engine/engine.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/cpu_device.h"

namespace hmoe {
namespace {

// Hugging Face builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps (1e-6)
// whatever config.rms_norm_eps says (MODEL-SPEC §3.2).
constexpr float kLatentNormEps = 1e-6f;

double SecondsSince(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

absl::Status CheckSupported(const ModelConfig& c) {
  if (c.scoring_func != "sigmoid") {
    return absl::UnimplementedError(
        absl::StrCat("engine: scoring_func \"", c.scoring_func, "\" (only sigmoid)"));
  }
  if (c.n_routed_experts > 0 && c.topk_method != "noaux_tc") {
    return absl::UnimplementedError(
        absl::StrCat("engine: topk_method \"", c.topk_method, "\" (only noaux_tc)"));
  }
  if (c.hidden_act != "silu") {
    return absl::UnimplementedError(
        absl::StrCat("engine: hidden_act \"", c.hidden_act, "\" (only silu)"));
  }
  if (c.n_routed_experts > 0 && c.num_experts_per_tok > 8) {
    return absl::UnimplementedError(
        absl::StrCat("engine: ", c.num_experts_per_tok, " experts per token (at most 8)"));
  }
  if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.num_hidden_layers <= 0 ||
      c.num_attention_heads <= 0 || c.kv_lora_rank <= 0 || c.qk_nope_head_dim <= 0 ||
      c.qk_rope_head_dim <= 0 || c.qk_rope_head_dim % 2 != 0 || c.v_head_dim <= 0 ||
      c.max_position_embeddings <= 0) {
    return absl::InvalidArgumentError("engine: config has a non-positive dimension");
  }
  return absl::OkStatus();
}

// A device buffer of `count` elements of T (at least one element, so pointers are never null).
template <typename T>
absl::StatusOr<DeviceBuffer> AllocateArray(Device& device, int64_t count) {
  return device.Allocate(static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T));
}

// Token lists of the experts of one MoE step: the tokens (rows) routed to each expert, with their
// routing weights, grouped by expert in increasing id order (rows in increasing order within an
// expert).
struct ExpertAssignment {
  std::vector<int64_t> begin;  // [E + 1] into rows/weights
  std::vector<int32_t> rows;
  std::vector<float> weights;

  void Build(int64_t num_experts, int64_t n, int64_t top_k, const int32_t* ids, const float* w) {
    begin.assign(num_experts + 1, 0);
    for (int64_t i = 0; i < n * top_k; ++i) ++begin[ids[i] + 1];
    for (int64_t e = 0; e < num_experts; ++e) begin[e + 1] += begin[e];
    rows.resize(n * top_k);
    weights.resize(n * top_k);
    std::vector<int64_t> fill(begin.begin(), begin.end() - 1);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < top_k; ++j) {
        const int32_t e = ids[t * top_k + j];
        rows[fill[e]] = static_cast<int32_t>(t);
        weights[fill[e]] = w[t * top_k + j];
        ++fill[e];
      }
    }
  }
};

}  // namespace

// ---------------------------------------------------------------------------------- constants

struct Engine::Constants {
  int64_t hidden = 0, nh = 0, dn = 0, dr = 0, dv = 0, dq = 0, rkv = 0, rq = 0, vocab = 0;
  int64_t dense_inter = 0;   // 0 without dense layers
  int64_t expert_inter = 0;  // largest expert MLP width (routed or shared)
  int64_t top_k = 0;
  float eps = 1e-6f;
  float attention_factor = 1.0f;
  MlaDimensions mla;
  MoeGateParams gate;
  DeviceBuffer inv_freq;  // on the attention device
  const cpu::Fp8Gemv* fp8 = nullptr;
};

// ---------------------------------------------------------------------------------- scratch

struct MicroBatch::Scratch {
  // Attention-device buffers, [max_step_tokens, width] F32 unless noted.
  DeviceBuffer h, x, delta, cq, q, kva, attn, g, u;
  DeviceBuffer tokens, positions, slots;    // int32 [T]
  DeviceBuffer router_ids, router_weights;  // [T, K]
  DeviceBuffer head_rows;                   // int32 [S]
  DeviceBuffer head_x, logits;              // [S, hidden], [S, vocab]
  DeviceBuffer block_tables;                // int32, grown on demand
  int64_t block_table_capacity = 0;
  // Device-placed experts: gathered rows, outputs, and the assignment on the device.
  DeviceBuffer xg, yg, assign_rows, assign_weights;

  // Host side.
  std::vector<int32_t> host_tokens, host_positions, host_slots, host_block_tables, host_head_rows;
  std::vector<MlaSegment> segments, decode_segments, prefill_segments;
  std::vector<float> host_embed;  // [T, hidden] when the device is not host accessible
  std::vector<float> host_x, host_delta, host_router_weights, host_logits;
  std::vector<int32_t> host_router_ids;
  ExpertAssignment assignment;
  // CPU experts' grouped path: buffers of the engine's host device.
  DeviceBuffer cpu_xg, cpu_g, cpu_u, cpu_yg, cpu_rows, cpu_weights;
  std::unique_ptr<Stream> host_stream;
  std::unique_ptr<MoeExecutor> moe;

  // The current step.
  struct Input {
    KvSequence* sequence = nullptr;
    int64_t start = 0;  // position of its first new token
    int64_t count = 0;
    int64_t row = 0;  // its first row in the step
    bool want_logits = false;
    int64_t commit_tokens = 0;  // the sequence's num_tokens() once the step finishes
  };
  std::vector<Input> inputs;
  int64_t num_tokens = 0;
  int64_t total_tokens = 0;  // distributed steps: the whole prompt
  KvCache* cache = nullptr;
};

// ---------------------------------------------------------------------------------- MicroBatch

MicroBatch::MicroBatch(Engine* engine) : engine_(engine) {}
MicroBatch::~MicroBatch() = default;

absl::Status MicroBatch::Init() {
  const Engine::Constants& k = *engine_->constants_;
  const EngineOptions& o = engine_->options_;
  Device& dev = *engine_->device_;
  const int64_t t = o.max_step_tokens;
  const int64_t s = o.max_step_sequences;
  HMOE_ASSIGN_OR_RETURN(stream_, dev.CreateStream());
  scratch_ = std::make_unique<Scratch>();
  Scratch& sc = *scratch_;
  HMOE_ASSIGN_OR_RETURN(sc.h, AllocateArray<float>(dev, t * k.hidden));
  HMOE_ASSIGN_OR_RETURN(sc.x, AllocateArray<float>(dev, t * k.hidden));
  HMOE_ASSIGN_OR_RETURN(sc.delta, AllocateArray<float>(dev, t * k.hidden));
  HMOE_ASSIGN_OR_RETURN(sc.cq, AllocateArray<float>(dev, t * k.rq));
  HMOE_ASSIGN_OR_RETURN(sc.q, AllocateArray<float>(dev, t * k.nh * k.dq));
  HMOE_ASSIGN_OR_RETURN(sc.kva, AllocateArray<float>(dev, t * (k.rkv + k.dr)));
  HMOE_ASSIGN_OR_RETURN(sc.attn, AllocateArray<float>(dev, t * k.nh * k.dv));
  const bool device_experts = o.experts == ExpertPlacement::kDevice;
  const int64_t mlp_width = std::max(k.dense_inter, device_experts ? k.expert_inter : 0);
  HMOE_ASSIGN_OR_RETURN(sc.g, AllocateArray<float>(dev, t * mlp_width));
  HMOE_ASSIGN_OR_RETURN(sc.u, AllocateArray<float>(dev, t * mlp_width));
  HMOE_ASSIGN_OR_RETURN(sc.tokens, AllocateArray<int32_t>(dev, t));
  HMOE_ASSIGN_OR_RETURN(sc.positions, AllocateArray<int32_t>(dev, t));
  HMOE_ASSIGN_OR_RETURN(sc.slots, AllocateArray<int32_t>(dev, t));
  HMOE_ASSIGN_OR_RETURN(sc.router_ids, AllocateArray<int32_t>(dev, t * k.top_k));
  HMOE_ASSIGN_OR_RETURN(sc.router_weights, AllocateArray<float>(dev, t * k.top_k));
  HMOE_ASSIGN_OR_RETURN(sc.head_rows, AllocateArray<int32_t>(dev, s));
  HMOE_ASSIGN_OR_RETURN(sc.head_x, AllocateArray<float>(dev, s * k.hidden));
  HMOE_ASSIGN_OR_RETURN(sc.logits, AllocateArray<float>(dev, s * k.vocab));
  if (device_experts && k.top_k > 0) {
    HMOE_ASSIGN_OR_RETURN(sc.xg, AllocateArray<float>(dev, t * k.hidden));
    HMOE_ASSIGN_OR_RETURN(sc.yg, AllocateArray<float>(dev, t * k.hidden));
    HMOE_ASSIGN_OR_RETURN(sc.assign_rows, AllocateArray<int32_t>(dev, t * k.top_k + t));
    HMOE_ASSIGN_OR_RETURN(sc.assign_weights, AllocateArray<float>(dev, t * k.top_k + t));
  }
  if (!dev.host_accessible()) {
    sc.host_embed.resize(t * k.hidden);
    sc.host_x.resize(t * k.hidden);
    sc.host_delta.resize(t * k.hidden);
    sc.host_router_ids.resize(t * k.top_k);
    sc.host_router_weights.resize(t * k.top_k);
  }
  sc.host_logits.resize(s * k.vocab);
  if (!device_experts && k.top_k > 0) {
    // The grouped CPU path, on the engine's host device.
    Device& host = *engine_->host_device_;
    HMOE_ASSIGN_OR_RETURN(sc.host_stream, host.CreateStream());
    HMOE_ASSIGN_OR_RETURN(sc.cpu_xg, AllocateArray<float>(host, t * k.hidden));
    HMOE_ASSIGN_OR_RETURN(sc.cpu_g, AllocateArray<float>(host, t * k.expert_inter));
    HMOE_ASSIGN_OR_RETURN(sc.cpu_u, AllocateArray<float>(host, t * k.expert_inter));
    HMOE_ASSIGN_OR_RETURN(sc.cpu_yg, AllocateArray<float>(host, t * k.hidden));
    HMOE_ASSIGN_OR_RETURN(sc.cpu_rows, AllocateArray<int32_t>(host, t * k.top_k + t));
    HMOE_ASSIGN_OR_RETURN(sc.cpu_weights, AllocateArray<float>(host, t * k.top_k + t));
    MoeExecutorOptions moe = o.moe;
    moe.max_tokens = cpu::kMaxMatVecTokens;
    moe.max_intermediate = std::max(moe.max_intermediate, k.expert_inter);
    HMOE_ASSIGN_OR_RETURN(sc.moe, MoeExecutor::Create(engine_->pool_, k.fp8, k.hidden, moe));
  }
  return absl::OkStatus();
}

void MicroBatch::Abort() {
  phase_ = Phase::kIdle;
  next_layer_ = 0;
  hooks_ = nullptr;
  if (scratch_ != nullptr) {
    // Blocks reserved for the step stay with their sequences (they will be reused when the
    // sequence continues); nothing was committed.
    scratch_->inputs.clear();
  }
}

void MicroBatch::AbandonStep() { Abort(); }

absl::Status MicroBatch::BeginStep(std::span<const SequenceInput> inputs) {
  if (phase_ != Phase::kIdle) {
    return absl::FailedPreconditionError("micro batch: BeginStep during a step");
  }
  const EngineOptions& o = engine_->options_;
  const ModelConfig& c = engine_->config_;
  Device& dev = *engine_->device_;
  Scratch& sc = *scratch_;
  const absl::Time start_time = absl::Now();
  stats_ = StepStats();

  if (inputs.empty()) return absl::InvalidArgumentError("step: no inputs");
  if (static_cast<int64_t>(inputs.size()) > o.max_step_sequences) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: ", inputs.size(), " sequences, at most ", o.max_step_sequences));
  }
  int64_t total = 0;
  KvCache* cache = nullptr;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SequenceInput& in = inputs[i];
    if (in.sequence == nullptr || in.sequence->cache() == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("step: input ", i, " has no KV sequence"));
    }
    if (in.tokens.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("step: input ", i, " has no tokens"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (inputs[j].sequence == in.sequence) {
        return absl::InvalidArgumentError(
            absl::StrCat("step: inputs ", j, " and ", i, " are the same sequence"));
      }
    }
    KvCache* seq_cache = in.sequence->cache();
    const KvCacheConfig& kc = seq_cache->config();
    if (&seq_cache->device() != &dev || kc.num_layers != c.num_hidden_layers ||
        kc.kv_lora_rank != c.kv_lora_rank || kc.rope_dim != c.qk_rope_head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step: input ", i, "'s KV cache is on another device or shaped for another model"));
    }
    if (cache != nullptr && seq_cache != cache) {
      return absl::InvalidArgumentError("step: sequences of different KV caches");
    }
    cache = seq_cache;
    for (size_t j = 0; j < in.tokens.size(); ++j) {
      if (in.tokens[j] < 0 || in.tokens[j] >= c.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("step: input ", i, " token ", j, " has id ",
                                                       in.tokens[j], ", outside [0, ", c.vocab_size,
                                                       ")"));
      }
    }
    const int64_t end = in.sequence->num_tokens() + static_cast<int64_t>(in.tokens.size());
    if (end > c.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat("step: input ", i, " reaches position ",
                                                     end - 1, ", beyond max_position_embeddings ",
                                                     c.max_position_embeddings));
    }
    total += static_cast<int64_t>(in.tokens.size());
  }
  if (total > o.max_step_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: ", total, " tokens, at most ", o.max_step_tokens, " per step"));
  }

  // Reserve KV blocks, all or nothing.
  for (size_t i = 0; i < inputs.size(); ++i) {
    KvSequence* seq = inputs[i].sequence;
    absl::Status reserved =
        seq->Reserve(seq->num_tokens() + static_cast<int64_t>(inputs[i].tokens.size()));
    if (!reserved.ok()) {
      for (size_t j = 0; j < i; ++j) inputs[j].sequence->Shrink(0);
      return reserved;
    }
  }

  // Step layout: rows in input order.
  sc.inputs.clear();
  sc.segments.clear();
  sc.host_tokens.clear();
  sc.host_positions.clear();
  sc.host_slots.clear();
  sc.host_block_tables.clear();
  sc.host_head_rows.clear();
  sc.cache = cache;
  const int64_t bs = cache->config().block_size;
  int64_t row = 0;
  for (const SequenceInput& in : inputs) {
    Scratch::Input si;
    si.sequence = in.sequence;
    si.start = in.sequence->num_tokens();
    si.count = static_cast<int64_t>(in.tokens.size());
    si.row = row;
    si.want_logits = in.want_logits;
    si.commit_tokens = si.start + si.count;
    MlaSegment seg;
    seg.query_begin = row;
    seg.num_queries = si.count;
    seg.start_pos = si.start;
    seg.block_table_offset = static_cast<int64_t>(sc.host_block_tables.size());
    const std::vector<int32_t>& table = in.sequence->block_table();
    const int64_t blocks = (si.start + si.count + bs - 1) / bs;
    sc.host_block_tables.insert(sc.host_block_tables.end(), table.begin(), table.begin() + blocks);
    for (int64_t j = 0; j < si.count; ++j) {
      const int64_t pos = si.start + j;
      sc.host_tokens.push_back(in.tokens[j]);
      sc.host_positions.push_back(static_cast<int32_t>(pos));
      sc.host_slots.push_back(static_cast<int32_t>(table[pos / bs] * bs + pos % bs));
    }
    if (si.want_logits) sc.host_head_rows.push_back(static_cast<int32_t>(row + si.count - 1));
    sc.segments.push_back(seg);
    sc.inputs.push_back(si);
    row += si.count;
  }
  sc.num_tokens = row;
  sc.decode_segments.clear();
  sc.prefill_segments.clear();
  for (const MlaSegment& seg : sc.segments) {
    (seg.num_queries == 1 ? sc.decode_segments : sc.prefill_segments).push_back(seg);
  }
  return UploadStep(start_time, static_cast<int64_t>(inputs.size()));
}

absl::Status MicroBatch::UploadStep(absl::Time start_time, int64_t num_sequences) {
  const Engine::Constants& k = *engine_->constants_;
  Device& dev = *engine_->device_;
  Scratch& sc = *scratch_;
  Stream& st = *stream_;
  const int64_t n = sc.num_tokens;
  if (static_cast<int64_t>(sc.host_block_tables.size()) > sc.block_table_capacity) {
    const int64_t capacity = std::max<int64_t>(1024, 2 * sc.host_block_tables.size());
    HMOE_ASSIGN_OR_RETURN(sc.block_tables, AllocateArray<int32_t>(dev, capacity));
    sc.block_table_capacity = capacity;
  }
  HMOE_RETURN_IF_ERROR(
      dev.CopyToDevice(st, sc.positions.data(), sc.host_positions.data(), n * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(
      dev.CopyToDevice(st, sc.slots.data(), sc.host_slots.data(), n * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(dev.CopyToDevice(st, sc.block_tables.data(), sc.host_block_tables.data(),
                                        sc.host_block_tables.size() * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(dev.CopyToDevice(st, sc.head_rows.data(), sc.host_head_rows.data(),
                                        sc.host_head_rows.size() * sizeof(int32_t)));

  // Embedding: rows gathered on the host (the table lives in host memory), then copied.
  const TensorView& table = engine_->weights_->host_embedding();
  float* embed = dev.host_accessible() ? sc.h.as<float>() : sc.host_embed.data();
  // Bytes per row (whole blocks for a GGUF block type; ConvertToFloat dequantizes those).
  const size_t row_bytes = DTypeBytes(table.dtype, k.hidden);
  for (int64_t t = 0; t < n; ++t) {
    HMOE_RETURN_IF_ERROR(
        ConvertToFloat(table.dtype, table.data + static_cast<size_t>(sc.host_tokens[t]) * row_bytes,
                       static_cast<size_t>(k.hidden), embed + t * k.hidden));
  }
  if (!dev.host_accessible()) {
    HMOE_RETURN_IF_ERROR(dev.CopyToDevice(st, sc.h.data(), embed,
                                          static_cast<size_t>(n * k.hidden) * sizeof(float)));
  }
  stats_.num_tokens = n;
  stats_.num_sequences = num_sequences;
  stats_.head_seconds += SecondsSince(start_time);
  phase_ = Phase::kAttention;
  next_layer_ = 0;
  return absl::OkStatus();
}

absl::Status MicroBatch::BeginDistributedStep(const DistributedStepInput& in) {
  if (phase_ != Phase::kIdle) {
    return absl::FailedPreconditionError("micro batch: BeginDistributedStep during a step");
  }
  const EngineOptions& o = engine_->options_;
  const ModelConfig& c = engine_->config_;
  Device& dev = *engine_->device_;
  Scratch& sc = *scratch_;
  const absl::Time start_time = absl::Now();
  stats_ = StepStats();

  if (in.hooks == nullptr) return absl::InvalidArgumentError("distributed step: no hooks");
  if (in.sequence == nullptr || in.sequence->cache() == nullptr) {
    return absl::InvalidArgumentError("distributed step: no KV sequence");
  }
  if (in.sequence->num_tokens() != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "distributed step: the KV sequence already holds ", in.sequence->num_tokens(), " tokens"));
  }
  KvCache* cache = in.sequence->cache();
  const KvCacheConfig& kc = cache->config();
  if (&cache->device() != &dev || kc.num_layers != c.num_hidden_layers ||
      kc.kv_lora_rank != c.kv_lora_rank || kc.rope_dim != c.qk_rope_head_dim) {
    return absl::InvalidArgumentError(
        "distributed step: the KV cache is on another device or shaped for another model");
  }
  const int64_t n = static_cast<int64_t>(in.tokens.size());
  if (n == 0 || in.positions.size() != in.tokens.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("distributed step: ", n, " tokens and ", in.positions.size(), " positions"));
  }
  if (n > o.max_step_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("distributed step: ", n, " tokens, at most ", o.max_step_tokens, " per step"));
  }
  if (in.total_tokens < n || in.total_tokens > c.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("distributed step: prompt of ", in.total_tokens,
                                                   " tokens (", n, " local, at most ",
                                                   c.max_position_embeddings, ")"));
  }
  for (int64_t j = 0; j < n; ++j) {
    if (in.tokens[j] < 0 || in.tokens[j] >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("distributed step: token ", j, " has id ",
                                                     in.tokens[j], ", outside [0, ", c.vocab_size,
                                                     ")"));
    }
    if (in.positions[j] < 0 || in.positions[j] >= in.total_tokens ||
        (j > 0 && in.positions[j] <= in.positions[j - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "distributed step: positions must increase within [0, ", in.total_tokens, ")"));
    }
  }
  if (in.want_logits && in.positions[n - 1] != in.total_tokens - 1) {
    return absl::InvalidArgumentError(
        "distributed step: logits wanted but the prompt's last token is not local");
  }
  HMOE_RETURN_IF_ERROR(in.sequence->Reserve(in.total_tokens));

  sc.inputs.clear();
  sc.segments.clear();
  sc.decode_segments.clear();
  sc.prefill_segments.clear();
  sc.host_tokens.assign(in.tokens.begin(), in.tokens.end());
  sc.host_positions.assign(in.positions.begin(), in.positions.end());
  sc.host_slots.clear();
  sc.host_head_rows.clear();
  sc.cache = cache;
  const int64_t bs = kc.block_size;
  const std::vector<int32_t>& table = in.sequence->block_table();
  const int64_t blocks = (in.total_tokens + bs - 1) / bs;
  sc.host_block_tables.assign(table.begin(), table.begin() + blocks);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = in.positions[j];
    sc.host_slots.push_back(static_cast<int32_t>(table[pos / bs] * bs + pos % bs));
  }
  if (in.want_logits) sc.host_head_rows.push_back(static_cast<int32_t>(n - 1));
  Scratch::Input si;
  si.sequence = in.sequence;
  si.start = 0;
  si.count = n;
  si.row = 0;
  si.want_logits = in.want_logits;
  si.commit_tokens = in.total_tokens;
  sc.inputs.push_back(si);
  sc.num_tokens = n;
  sc.total_tokens = in.total_tokens;
  hooks_ = in.hooks;
  absl::Status uploaded = UploadStep(start_time, 1);
  if (!uploaded.ok()) Abort();
  return uploaded;
}

absl::Status MicroBatch::RunAttention(int64_t layer) {
  if (phase_ != Phase::kAttention || layer != next_layer_) {
    return absl::FailedPreconditionError(
        absl::StrCat("micro batch: RunAttention(", layer, ") out of order"));
  }
  const absl::Time start = absl::Now();
  absl::Status s = AttentionImpl(layer);
  stats_.attention_seconds += SecondsSince(start);
  if (!s.ok()) {
    Abort();
    return s;
  }
  phase_ = Phase::kFfn;
  return absl::OkStatus();
}

absl::Status MicroBatch::AttentionImpl(int64_t layer) {
  const Engine::Constants& k = *engine_->constants_;
  Device& dev = *engine_->device_;
  Scratch& sc = *scratch_;
  Stream& st = *stream_;
  const int64_t n = sc.num_tokens;
  const int64_t hd = k.hidden;
  const ModuleId id{ModuleKind::kAttention, static_cast<int32_t>(layer), -1};
  HMOE_ASSIGN_OR_RETURN(const ModuleWeights* mw, engine_->weights_->Acquire(id, st));
  const AttentionWeights& w = mw->attention;
  float* h = sc.h.as<float>();
  float* x = sc.x.as<float>();
  float* q = sc.q.as<float>();
  float* kva = sc.kva.as<float>();
  const int64_t q_width = k.nh * k.dq;
  const int64_t kv_width = k.rkv + k.dr;

  HMOE_RETURN_IF_ERROR(dev.RmsNorm(st, h, hd, n, hd, w.input_norm, k.eps, x, hd));
  if (k.rq > 0) {
    float* cq = sc.cq.as<float>();
    HMOE_RETURN_IF_ERROR(dev.Linear(st, w.q_a, x, hd, n, cq, k.rq));
    HMOE_RETURN_IF_ERROR(dev.RmsNorm(st, cq, k.rq, n, k.rq, w.q_a_norm, kLatentNormEps, cq, k.rq));
    HMOE_RETURN_IF_ERROR(dev.Linear(st, w.q_b, cq, k.rq, n, q, q_width));
  } else {
    HMOE_RETURN_IF_ERROR(dev.Linear(st, w.q, x, hd, n, q, q_width));
  }
  HMOE_RETURN_IF_ERROR(dev.Linear(st, w.kv_a, x, hd, n, kva, kv_width));
  HMOE_RETURN_IF_ERROR(
      dev.RmsNorm(st, kva, kv_width, n, k.rkv, w.kv_a_norm, kLatentNormEps, kva, kv_width));
  const int32_t* positions = sc.positions.as<int32_t>();
  const float* inv_freq = k.inv_freq.as<float>();
  HMOE_RETURN_IF_ERROR(dev.RopeInterleaved(st, q + k.dn, q_width, n, k.nh, k.dq, k.dr, positions,
                                           inv_freq, k.attention_factor));
  HMOE_RETURN_IF_ERROR(dev.RopeInterleaved(st, kva + k.rkv, kv_width, n, 1, kv_width, k.dr,
                                           positions, inv_freq, k.attention_factor));
  const KvLayerView cache = sc.cache->layer_view(layer);
  HMOE_RETURN_IF_ERROR(dev.KvCacheWrite(st, cache, sc.slots.as<int32_t>(), n, kva, kv_width,
                                        kva + k.rkv, kv_width, k.rkv));

  if (hooks_ != nullptr) {
    AttentionHookArgs hook;
    hook.layer = layer;
    hook.stream = &st;
    hook.weights = &w;
    hook.dims = k.mla;
    hook.q = q;
    hook.q_stride = q_width;
    hook.kv = kva;
    hook.kv_stride = kv_width;
    hook.num_tokens = n;
    hook.total_tokens = sc.total_tokens;
    hook.cache = cache;
    hook.block_table = sc.block_tables.as<int32_t>();
    hook.out = sc.attn.as<float>();
    hook.out_stride = k.nh * k.dv;
    HMOE_RETURN_IF_ERROR(hooks_->Attention(hook));
  } else {
    MlaAttentionArgs args;
    args.dims = k.mla;
    args.q = q;
    args.q_stride = q_width;
    args.w_uk_t = w.w_uk_t;
    args.kv_b = w.kv_b;
    args.cache = cache;
    args.block_tables = sc.block_tables.as<int32_t>();
    args.out = sc.attn.as<float>();
    args.out_stride = k.nh * k.dv;
    if (!sc.decode_segments.empty()) {
      args.segments = sc.decode_segments;
      HMOE_RETURN_IF_ERROR(dev.MlaDecodeAttention(st, args));
    }
    if (!sc.prefill_segments.empty()) {
      args.segments = sc.prefill_segments;
      HMOE_RETURN_IF_ERROR(dev.MlaPrefillAttention(st, args));
    }
  }
  float* delta = sc.delta.as<float>();
  HMOE_RETURN_IF_ERROR(dev.Linear(st, w.o, sc.attn.as<float>(), k.nh * k.dv, n, delta, hd));
  HMOE_RETURN_IF_ERROR(dev.Add(st, h, delta, n * hd, h));
  HMOE_RETURN_IF_ERROR(dev.RmsNorm(st, h, hd, n, hd, w.post_norm, k.eps, x, hd));
  if (engine_->config_.is_moe_layer(layer)) {
    if (hooks_ != nullptr) {
      RouteHookArgs hook;
      hook.layer = layer;
      hook.stream = &st;
      hook.router = &w.router;
      hook.router_bias = &w.router_bias;
      hook.params = k.gate;
      hook.x = x;
      hook.num_tokens = n;
      hook.ids = sc.router_ids.as<int32_t>();
      hook.weights = sc.router_weights.as<float>();
      HMOE_RETURN_IF_ERROR(hooks_->Route(hook));
    } else {
      HMOE_RETURN_IF_ERROR(dev.MoeGate(st, x, hd, n, w.router, w.router_bias, k.gate,
                                       sc.router_ids.as<int32_t>(), sc.router_weights.as<float>()));
    }
  }
  return engine_->weights_->Release(id, st);
}

absl::Status MicroBatch::RunFfn(int64_t layer) {
  if (phase_ != Phase::kFfn || layer != next_layer_) {
    return absl::FailedPreconditionError(
        absl::StrCat("micro batch: RunFfn(", layer, ") out of order"));
  }
  const absl::Time start = absl::Now();
  absl::Status s = FfnImpl(layer);
  stats_.ffn_seconds += SecondsSince(start);
  if (!s.ok()) {
    Abort();
    return s;
  }
  ++next_layer_;
  phase_ = next_layer_ == engine_->config_.num_hidden_layers ? Phase::kHead : Phase::kAttention;
  return absl::OkStatus();
}

absl::Status MicroBatch::FfnImpl(int64_t layer) {
  Device& dev = *engine_->device_;
  Scratch& sc = *scratch_;
  const int64_t count = sc.num_tokens * engine_->constants_->hidden;
  if (!engine_->config_.is_moe_layer(layer)) {
    HMOE_RETURN_IF_ERROR(DenseMlp(layer));
  } else if (hooks_ != nullptr) {
    MoeHookArgs hook;
    hook.layer = layer;
    hook.stream = stream_.get();
    hook.x = sc.x.as<float>();
    hook.num_tokens = sc.num_tokens;
    hook.ids = sc.router_ids.as<int32_t>();
    hook.weights = sc.router_weights.as<float>();
    hook.delta = sc.delta.as<float>();
    HMOE_RETURN_IF_ERROR(hooks_->Moe(hook));
  } else if (engine_->options_.experts == ExpertPlacement::kDevice) {
    HMOE_RETURN_IF_ERROR(ExpertsOnDevice(layer));
  } else {
    HMOE_RETURN_IF_ERROR(ExpertsOnCpu(layer));
  }
  return dev.Add(*stream_, sc.h.as<float>(), sc.delta.as<float>(), count, sc.h.as<float>());
}

absl::Status MicroBatch::DenseMlp(int64_t layer) {
  const Engine::Constants& k = *engine_->constants_;
  Device& dev = *engine_->device_;
  Scratch& sc = *scratch_;
  Stream& st = *stream_;
  const int64_t n = sc.num_tokens;
  const ModuleId id{ModuleKind::kDenseMlp, static_cast<int32_t>(layer), -1};
  HMOE_ASSIGN_OR_RETURN(const ModuleWeights* mw, engine_->weights_->Acquire(id, st));
  const MlpWeights& m = mw->mlp;
  const int64_t inter = m.gate.rows;
  if (inter > k.dense_inter) return absl::InternalError("dense mlp wider than its scratch");
  float* g = sc.g.as<float>();
  float* u = sc.u.as<float>();
  HMOE_RETURN_IF_ERROR(dev.Linear(st, m.gate, sc.x.as<float>(), k.hidden, n, g, inter));
  HMOE_RETURN_IF_ERROR(dev.Linear(st, m.up, sc.x.as<float>(), k.hidden, n, u, inter));
  HMOE_RETURN_IF_ERROR(dev.SiluMul(st, g, u, n * inter, g));
  HMOE_RETURN_IF_ERROR(dev.Linear(st, m.down, g, inter, n, sc.delta.as<float>(), k.hidden));
  return engine_->weights_->Release(id, st);
}

namespace {

// The grouped expert path on `dev`: for every expert with tokens, gather its rows of x, run the
// SwiGLU MLP on them (GEMM-sized), and add the weighted result into `out` (zeroed first).
// `expert(e)` returns expert e's weights (and is called for every expert, in id order, so a
// streaming provider advances); `shared` (nullable) runs on all rows with weight 1. Each output
// row is summed from zero in a fixed order: shared experts first, then the routed experts in
// increasing id order (ScatterAddRows adds in order). MoeExecutor (the decode path) uses the same
// order, so a token's result does not depend on which path its step takes.
struct GroupedBuffers {
  float* xg;       // [T, hidden]
  float* g;        // [T, width]
  float* u;        // [T, width]
  float* yg;       // [T, hidden]
  int32_t* rows;   // device copy of the assignment rows, then identity rows
  float* weights;  // device copy of the assignment weights, then ones
};

absl::Status RunGroupedExperts(
    Device& dev, Stream& st, const ExpertAssignment& assign, int64_t num_experts, int64_t n,
    int64_t hidden, const float* x, float* out, const GroupedBuffers& b,
    absl::FunctionRef<absl::StatusOr<const MlpWeights*>(int64_t expert)> expert,
    absl::FunctionRef<absl::Status(int64_t expert)> release, const MlpWeights* shared,
    int64_t* weight_bytes) {
  const int64_t pairs = static_cast<int64_t>(assign.rows.size());
  HMOE_RETURN_IF_ERROR(dev.Memset(st, out, 0, static_cast<size_t>(n * hidden) * sizeof(float)));
  HMOE_RETURN_IF_ERROR(dev.CopyToDevice(st, b.rows, assign.rows.data(), pairs * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(
      dev.CopyToDevice(st, b.weights, assign.weights.data(), pairs * sizeof(float)));
  // Identity rows and unit weights after the assignment, for the shared experts.
  std::vector<int32_t> identity(n);
  std::vector<float> ones(n, 1.0f);
  for (int64_t t = 0; t < n; ++t) identity[t] = static_cast<int32_t>(t);
  HMOE_RETURN_IF_ERROR(dev.CopyToDevice(st, b.rows + pairs, identity.data(), n * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(dev.CopyToDevice(st, b.weights + pairs, ones.data(), n * sizeof(float)));

  auto mlp = [&](const MlpWeights& m, const float* in, int64_t rows, const int32_t* dst_rows,
                 const float* dst_weights) -> absl::Status {
    const int64_t inter = m.gate.rows;
    HMOE_RETURN_IF_ERROR(dev.Linear(st, m.gate, in, hidden, rows, b.g, inter));
    HMOE_RETURN_IF_ERROR(dev.Linear(st, m.up, in, hidden, rows, b.u, inter));
    HMOE_RETURN_IF_ERROR(dev.SiluMul(st, b.g, b.u, rows * inter, b.g));
    HMOE_RETURN_IF_ERROR(dev.Linear(st, m.down, b.g, inter, rows, b.yg, hidden));
    HMOE_RETURN_IF_ERROR(
        dev.ScatterAddRows(st, b.yg, hidden, dst_rows, dst_weights, rows, hidden, out, hidden));
    for (const LinearWeight* w : {&m.gate, &m.up, &m.down}) {
      if (w->dtype == DType::kF8E4M3) {
        *weight_bytes += w->rows * w->cols + ((w->rows + 127) / 128) * ((w->cols + 127) / 128) * 4;
      } else {
        *weight_bytes += static_cast<int64_t>(DTypeBytes(w->dtype, w->rows * w->cols));
      }
    }
    return absl::OkStatus();
  };
  if (shared != nullptr) {
    HMOE_RETURN_IF_ERROR(mlp(*shared, x, n, b.rows + pairs, b.weights + pairs));
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    HMOE_ASSIGN_OR_RETURN(const MlpWeights* m, expert(e));
    const int64_t begin = assign.begin[e];
    const int64_t rows = assign.begin[e + 1] - begin;
    if (rows > 0) {
      HMOE_RETURN_IF_ERROR(
          dev.GatherRows(st, x, hidden, b.rows + begin, rows, hidden, b.xg, hidden));
      HMOE_RETURN_IF_ERROR(mlp(*m, b.xg, rows, b.rows + begin, b.weights + begin));
    }
    HMOE_RETURN_IF_ERROR(release(e));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MicroBatch::ExpertsOnCpu(int64_t layer) {
  const Engine::Constants& k = *engine_->constants_;
  const EngineOptions& o = engine_->options_;
  Device& dev = *engine_->device_;
  Scratch& sc = *scratch_;
  Stream& st = *stream_;
  const int64_t n = sc.num_tokens;
  const HostMoeWeights* host = engine_->weights_->host_moe(layer);
  if (host == nullptr || host->routed.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("engine: no host experts for MoE layer ", layer));
  }
  // The normalized input and the routing in host memory.
  const float* x = sc.x.as<float>();
  const int32_t* ids = sc.router_ids.as<int32_t>();
  const float* weights = sc.router_weights.as<float>();
  float* delta = sc.delta.as<float>();
  if (!dev.host_accessible()) {
    HMOE_RETURN_IF_ERROR(dev.CopyToHost(st, sc.host_x.data(), x, n * k.hidden * sizeof(float)));
    HMOE_RETURN_IF_ERROR(
        dev.CopyToHost(st, sc.host_router_ids.data(), ids, n * k.top_k * sizeof(int32_t)));
    HMOE_RETURN_IF_ERROR(
        dev.CopyToHost(st, sc.host_router_weights.data(), weights, n * k.top_k * sizeof(float)));
    HMOE_RETURN_IF_ERROR(st.Synchronize());
    x = sc.host_x.data();
    ids = sc.host_router_ids.data();
    weights = sc.host_router_weights.data();
    delta = sc.host_delta.data();
  }

  if (o.routing_observer) o.routing_observer(layer, n, k.top_k, ids);
  const bool use_executor = !host->parts.routed.empty() && n < o.grouped_moe_min_tokens;
  if (use_executor) {
    CpuWorkerPool* pool = engine_->pool_;
    for (int64_t t0 = 0; t0 < n; t0 += cpu::kMaxMatVecTokens) {
      const int64_t nt = std::min<int64_t>(cpu::kMaxMatVecTokens, n - t0);
      MoeRouting routing;
      routing.top_k = static_cast<int>(k.top_k);
      routing.ids = std::span<const int32_t>(ids + t0 * k.top_k, nt * k.top_k);
      routing.weights = std::span<const float>(weights + t0 * k.top_k, nt * k.top_k);
      std::lock_guard<std::mutex> lock(CpuPoolMutex(pool));
      HMOE_RETURN_IF_ERROR(
          sc.moe->Forward(host->parts, std::span<const float>(x + t0 * k.hidden, nt * k.hidden),
                          routing, std::span<float>(delta + t0 * k.hidden, nt * k.hidden)));
      stats_.expert_weight_bytes += sc.moe->last_weight_bytes();
    }
  } else {
    Device& hdev = *engine_->host_device_;
    sc.assignment.Build(k.gate.num_experts, n, k.top_k, ids, weights);
    GroupedBuffers b{sc.cpu_xg.as<float>(), sc.cpu_g.as<float>(),      sc.cpu_u.as<float>(),
                     sc.cpu_yg.as<float>(), sc.cpu_rows.as<int32_t>(), sc.cpu_weights.as<float>()};
    HMOE_RETURN_IF_ERROR(RunGroupedExperts(
        hdev, *sc.host_stream, sc.assignment, k.gate.num_experts, n, k.hidden, x, delta, b,
        [&](int64_t e) -> absl::StatusOr<const MlpWeights*> { return &host->routed[e]; },
        [](int64_t) { return absl::OkStatus(); }, host->shared.empty() ? nullptr : &host->shared[0],
        &stats_.expert_weight_bytes));
  }
  if (!dev.host_accessible()) {
    HMOE_RETURN_IF_ERROR(
        dev.CopyToDevice(st, sc.delta.data(), sc.host_delta.data(), n * k.hidden * sizeof(float)));
  }
  return absl::OkStatus();
}

absl::Status MicroBatch::ExpertsOnDevice(int64_t layer) {
  const Engine::Constants& k = *engine_->constants_;
  Device& dev = *engine_->device_;
  Scratch& sc = *scratch_;
  Stream& st = *stream_;
  const int64_t n = sc.num_tokens;
  WeightProvider& wp = *engine_->weights_;
  // The routing on the host, to build the per-expert token lists.
  sc.host_router_ids.resize(n * k.top_k);
  sc.host_router_weights.resize(n * k.top_k);
  HMOE_RETURN_IF_ERROR(dev.CopyToHost(st, sc.host_router_ids.data(), sc.router_ids.data(),
                                      n * k.top_k * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(dev.CopyToHost(st, sc.host_router_weights.data(), sc.router_weights.data(),
                                      n * k.top_k * sizeof(float)));
  HMOE_RETURN_IF_ERROR(st.Synchronize());
  if (engine_->options_.routing_observer) {
    engine_->options_.routing_observer(layer, n, k.top_k, sc.host_router_ids.data());
  }
  sc.assignment.Build(k.gate.num_experts, n, k.top_k, sc.host_router_ids.data(),
                      sc.host_router_weights.data());
  const int32_t l = static_cast<int32_t>(layer);
  const MlpWeights* shared = nullptr;
  const ModuleId shared_id{ModuleKind::kSharedExperts, l, -1};
  const bool has_shared = engine_->config_.n_shared_experts > 0;
  if (has_shared) {
    HMOE_ASSIGN_OR_RETURN(const ModuleWeights* mw, wp.Acquire(shared_id, st));
    shared = &mw->mlp;
  }
  GroupedBuffers b{sc.xg.as<float>(),
                   sc.g.as<float>(),
                   sc.u.as<float>(),
                   sc.yg.as<float>(),
                   sc.assign_rows.as<int32_t>(),
                   sc.assign_weights.as<float>()};
  HMOE_RETURN_IF_ERROR(RunGroupedExperts(
      dev, st, sc.assignment, k.gate.num_experts, n, k.hidden, sc.x.as<float>(),
      sc.delta.as<float>(), b,
      [&](int64_t e) -> absl::StatusOr<const MlpWeights*> {
        HMOE_ASSIGN_OR_RETURN(
            const ModuleWeights* mw,
            wp.Acquire({ModuleKind::kRoutedExpert, l, static_cast<int32_t>(e)}, st));
        return &mw->mlp;
      },
      [&](int64_t e) {
        return wp.Release({ModuleKind::kRoutedExpert, l, static_cast<int32_t>(e)}, st);
      },
      shared, &stats_.expert_weight_bytes));
  if (has_shared) HMOE_RETURN_IF_ERROR(wp.Release(shared_id, st));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<float>>> MicroBatch::FinishStep() {
  if (phase_ != Phase::kHead) {
    return absl::FailedPreconditionError("micro batch: FinishStep before the last layer");
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<std::vector<float>>> out = HeadImpl();
  stats_.head_seconds += SecondsSince(start);
  if (!out.ok()) {
    Abort();
    return out.status();
  }
  for (const Scratch::Input& in : scratch_->inputs) {
    in.sequence->SetNumTokens(in.commit_tokens);
  }
  scratch_->inputs.clear();
  phase_ = Phase::kIdle;
  next_layer_ = 0;
  hooks_ = nullptr;
  return out;
}

absl::StatusOr<std::vector<std::vector<float>>> MicroBatch::HeadImpl() {
  const Engine::Constants& k = *engine_->constants_;
  Device& dev = *engine_->device_;
  Scratch& sc = *scratch_;
  Stream& st = *stream_;
  std::vector<std::vector<float>> result(sc.inputs.size());
  const int64_t m = static_cast<int64_t>(sc.host_head_rows.size());
  // The head is acquired every step, logits or not, so a streaming provider sees a fixed order;
  // it may leave it out of the steps that want no logits (HeadStreaming).
  const ModuleId id{ModuleKind::kHead, -1, -1};
  HMOE_ASSIGN_OR_RETURN(const ModuleWeights* mw, engine_->weights_->Acquire(id, st));
  if (m == 0) {
    HMOE_RETURN_IF_ERROR(engine_->weights_->Release(id, st));
    HMOE_RETURN_IF_ERROR(st.Synchronize());
    return result;
  }
  const HeadWeights& w = mw->head;
  if (w.lm_head.data == nullptr) {
    HMOE_RETURN_IF_ERROR(engine_->weights_->Release(id, st));
    return absl::FailedPreconditionError(
        "engine: a sequence wants logits but the weight provider did not load the head for this "
        "step (StreamingWeights::BeginPrefill with HeadStreaming::kLastPass or kNever)");
  }
  float* hx = sc.head_x.as<float>();
  HMOE_RETURN_IF_ERROR(dev.GatherRows(st, sc.h.as<float>(), k.hidden, sc.head_rows.as<int32_t>(), m,
                                      k.hidden, hx, k.hidden));
  HMOE_RETURN_IF_ERROR(
      dev.RmsNorm(st, hx, k.hidden, m, k.hidden, w.final_norm, k.eps, hx, k.hidden));
  HMOE_RETURN_IF_ERROR(dev.Linear(st, w.lm_head, hx, k.hidden, m, sc.logits.as<float>(), k.vocab));
  HMOE_RETURN_IF_ERROR(dev.CopyToHost(st, sc.host_logits.data(), sc.logits.data(),
                                      static_cast<size_t>(m * k.vocab) * sizeof(float)));
  HMOE_RETURN_IF_ERROR(engine_->weights_->Release(id, st));
  HMOE_RETURN_IF_ERROR(st.Synchronize());
  int64_t next = 0;
  for (size_t i = 0; i < sc.inputs.size(); ++i) {
    if (!sc.inputs[i].want_logits) continue;
    const float* row = sc.host_logits.data() + next * k.vocab;
    result[i].assign(row, row + k.vocab);
    ++next;
  }
  return result;
}

absl::StatusOr<std::vector<std::vector<float>>> MicroBatch::RunStep(
    std::span<const SequenceInput> inputs) {
  HMOE_RETURN_IF_ERROR(BeginStep(inputs));
  for (int64_t l = 0; l < engine_->config_.num_hidden_layers; ++l) {
    HMOE_RETURN_IF_ERROR(RunAttention(l));
    HMOE_RETURN_IF_ERROR(RunFfn(l));
  }
  return FinishStep();
}

// ---------------------------------------------------------------------------------- Engine

Engine::Engine(const ModelConfig& config, WeightProvider* weights, Device* device,
               CpuWorkerPool* pool, const EngineOptions& options)
    : config_(config), weights_(weights), device_(device), pool_(pool), options_(options) {}

Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const ModelConfig& config,
                                                       WeightProvider& weights,
                                                       Device& attention_device,
                                                       CpuWorkerPool& pool,
                                                       const EngineOptions& options) {
  HMOE_RETURN_IF_ERROR(CheckSupported(config));
  if (options.max_step_tokens < 1 || options.max_step_sequences < 1 ||
      options.grouped_moe_min_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine: bad options (max_step_tokens ", options.max_step_tokens,
                     ", max_step_sequences ", options.max_step_sequences,
                     ", grouped_moe_min_tokens ", options.grouped_moe_min_tokens, ")"));
  }
  std::unique_ptr<Engine> engine(new Engine(config, &weights, &attention_device, &pool, options));
  HMOE_RETURN_IF_ERROR(engine->Init());
  return engine;
}

absl::Status Engine::Init() {
  const ModelConfig& c = config_;
  constants_ = std::make_unique<Constants>();
  Constants& k = *constants_;
  k.hidden = c.hidden_size;
  k.nh = c.num_attention_heads;
  k.dn = c.qk_nope_head_dim;
  k.dr = c.qk_rope_head_dim;
  k.dv = c.v_head_dim;
  k.dq = k.dn + k.dr;
  k.rkv = c.kv_lora_rank;
  k.rq = c.q_lora_rank.value_or(0);
  k.vocab = c.vocab_size;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_moe_layer(l)) k.dense_inter = c.intermediate_size;
  }
  k.expert_inter = c.n_routed_experts > 0
                       ? c.moe_intermediate_size * std::max<int64_t>(1, c.n_shared_experts)
                       : 0;
  k.top_k = c.n_routed_experts > 0 ? c.num_experts_per_tok : 0;
  k.eps = static_cast<float>(c.rms_norm_eps);
  k.attention_factor = static_cast<float>(c.rope_attention_factor());
  k.mla.num_heads = k.nh;
  k.mla.nope_dim = k.dn;
  k.mla.rope_dim = k.dr;
  k.mla.v_dim = k.dv;
  k.mla.kv_lora_rank = k.rkv;
  k.mla.softmax_scale = static_cast<float>(c.softmax_scale());
  k.gate.num_experts = c.n_routed_experts;
  k.gate.top_k = k.top_k;
  k.gate.n_group = c.n_group;
  k.gate.topk_group = c.topk_group;
  k.gate.norm_topk_prob = c.norm_topk_prob;
  k.gate.routed_scaling_factor = c.routed_scaling_factor;
  k.fp8 = options_.fp8_gemv != nullptr ? options_.fp8_gemv : &cpu::DefaultFp8Gemv();

  const std::vector<float> inv_freq = c.rope_inv_freq();
  HMOE_ASSIGN_OR_RETURN(k.inv_freq, AllocateArray<float>(*device_, inv_freq.size()));
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device_->CreateStream());
  HMOE_RETURN_IF_ERROR(device_->CopyToDevice(*stream, k.inv_freq.data(), inv_freq.data(),
                                             inv_freq.size() * sizeof(float)));
  HMOE_RETURN_IF_ERROR(stream->Synchronize());

  CpuDeviceOptions host_options;
  host_options.pool = pool_;
  host_options.fp8_gemv = k.fp8;
  host_device_ = NewCpuDevice(host_options);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MicroBatch>> Engine::NewMicroBatch() {
  std::unique_ptr<MicroBatch> batch(new MicroBatch(this));
  HMOE_RETURN_IF_ERROR(batch->Init());
  return batch;
}

const StepStats& Engine::last_step_stats() const {
  static const StepStats kEmpty;
  return forward_batch_ != nullptr ? forward_batch_->last_step_stats() : kEmpty;
}

absl::StatusOr<std::vector<std::vector<float>>> Engine::Forward(
    std::span<const SequenceInput> inputs) {
  if (forward_batch_ == nullptr) {
    HMOE_ASSIGN_OR_RETURN(forward_batch_, NewMicroBatch());
  }
  if (inputs.empty()) return absl::InvalidArgumentError("forward: no inputs");
  int64_t total = 0;
  for (const SequenceInput& in : inputs) total += static_cast<int64_t>(in.tokens.size());
  if (total <= options_.max_step_tokens &&
      static_cast<int64_t>(inputs.size()) <= options_.max_step_sequences) {
    return forward_batch_->RunStep(inputs);
  }
  // Several steps: fill each with as many tokens as fit, splitting long inputs into chunks.
  for (const SequenceInput& in : inputs) {
    if (in.tokens.empty()) return absl::InvalidArgumentError("forward: an input has no tokens");
  }
  std::vector<std::vector<float>> result(inputs.size());
  std::vector<size_t> done(inputs.size(), 0);
  size_t first = 0;  // inputs before this one are finished
  while (first < inputs.size()) {
    std::vector<SequenceInput> step;
    std::vector<size_t> origin;
    int64_t room = options_.max_step_tokens;
    for (size_t i = first; i < inputs.size() && room > 0 &&
                           static_cast<int64_t>(step.size()) < options_.max_step_sequences;
         ++i) {
      const size_t left = inputs[i].tokens.size() - done[i];
      if (left == 0) continue;
      const size_t take = std::min<size_t>(left, static_cast<size_t>(room));
      SequenceInput part = inputs[i];
      part.tokens = inputs[i].tokens.subspan(done[i], take);
      part.want_logits = inputs[i].want_logits && take == left;
      step.push_back(part);
      origin.push_back(i);
      room -= static_cast<int64_t>(take);
    }
    HMOE_ASSIGN_OR_RETURN(std::vector<std::vector<float>> logits, forward_batch_->RunStep(step));
    for (size_t j = 0; j < step.size(); ++j) {
      const size_t i = origin[j];
      done[i] += step[j].tokens.size();
      if (done[i] == inputs[i].tokens.size()) result[i] = std::move(logits[j]);
    }
    while (first < inputs.size() && done[first] == inputs[first].tokens.size()) ++first;
  }
  return result;
}

}  // namespace hmoe

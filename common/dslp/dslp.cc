#include "common/dslp/dslp.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"

namespace hmoe {
namespace {

double Since(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

// A device buffer that grows on demand and never shrinks (its contents do not survive a growth).
class GrowingBuffer {
 public:
  template <typename T>
  absl::StatusOr<T*> Get(Device& device, int64_t count) {
    const size_t bytes =
        std::max<size_t>(64, static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T));
    if (buffer_.size_bytes() < bytes) {
      buffer_.Reset();
      HMOE_ASSIGN_OR_RETURN(buffer_, device.Allocate(bytes));
    }
    return buffer_.as<T>();
  }
  void Reset() { buffer_.Reset(); }

 private:
  DeviceBuffer buffer_;
};

// Byte layout of per-rank row blocks for the collectives.
struct Layout {
  std::vector<size_t> counts, offsets;

  static Layout Rows(const std::vector<int64_t>& rows, int64_t row_bytes) {
    Layout l;
    size_t offset = 0;
    for (int64_t r : rows) {
      l.counts.push_back(static_cast<size_t>(r * row_bytes));
      l.offsets.push_back(offset);
      offset += l.counts.back();
    }
    return l;
  }
};

}  // namespace

// ---------------------------------------------------------------------------------- names, plans

const char* EpModeName(EpMode mode) { return mode == EpMode::kStandard ? "standard" : "small_ep"; }

absl::StatusOr<EpMode> ParseEpMode(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "standard") return EpMode::kStandard;
  if (lower == "small_ep" || lower == "smallep") return EpMode::kSmallEp;
  return absl::InvalidArgumentError(
      absl::StrCat("ep mode \"", name, "\": expected standard or small_ep"));
}

absl::StatusOr<ZigZagPlan> ZigZagPlan::Make(int64_t num_tokens, int world_size) {
  if (world_size < 1) return absl::InvalidArgumentError("zig-zag plan: world size < 1");
  const int64_t chunks = 2 * static_cast<int64_t>(world_size);
  if (num_tokens < chunks) {
    return absl::InvalidArgumentError(absl::StrCat("zig-zag plan: a prompt of ", num_tokens,
                                                   " tokens cannot be split over ", world_size,
                                                   " ranks (at least ", chunks, " tokens)"));
  }
  ZigZagPlan p;
  p.num_tokens_ = num_tokens;
  p.world_size_ = world_size;
  p.bounds_.assign(chunks + 1, 0);
  const int64_t base = num_tokens / chunks;
  const int64_t extra = num_tokens % chunks;
  for (int64_t c = 0; c < chunks; ++c) p.bounds_[c + 1] = p.bounds_[c] + base + (c < extra ? 1 : 0);
  return p;
}

int64_t ZigZagPlan::tokens_of(int rank) const {
  const int a = first_chunk(rank), b = second_chunk(rank);
  return chunk_end(a) - chunk_begin(a) + chunk_end(b) - chunk_begin(b);
}

std::vector<int32_t> ZigZagPlan::positions_of(int rank) const {
  std::vector<int32_t> positions;
  for (int c : {first_chunk(rank), second_chunk(rank)}) {
    for (int64_t p = chunk_begin(c); p < chunk_end(c); ++p) {
      positions.push_back(static_cast<int32_t>(p));
    }
  }
  return positions;
}

int64_t FirstExpertOfRank(int64_t num_experts, int world_size, int rank) {
  return num_experts * rank / world_size;
}

int RankOfExpert(int64_t num_experts, int world_size, int64_t expert) {
  // The largest r with FirstExpertOfRank(r) <= expert.
  int r = static_cast<int>(expert * world_size / std::max<int64_t>(num_experts, 1));
  while (r + 1 < world_size && FirstExpertOfRank(num_experts, world_size, r + 1) <= expert) ++r;
  while (r > 0 && FirstExpertOfRank(num_experts, world_size, r) > expert) --r;
  return r;
}

DslpLayerStats DslpStats::Sum() const {
  DslpLayerStats s;
  for (const DslpLayerStats& l : layers) {
    s.attention_other_s += l.attention_other_s;
    s.attention_local_s += l.attention_local_s;
    s.ring_s += l.ring_s;
    s.attention_remote_s += l.attention_remote_s;
    s.attention_project_s += l.attention_project_s;
    s.gate_sort_s += l.gate_sort_s;
    s.dispatch_s += l.dispatch_s;
    s.experts_s += l.experts_s;
    s.shared_s += l.shared_s;
    s.combine_s += l.combine_s;
    s.reduce_s += l.reduce_s;
    s.ffn_other_s += l.ffn_other_s;
    s.ring_bytes += l.ring_bytes;
    s.dispatch_bytes += l.dispatch_bytes;
    s.combine_bytes += l.combine_bytes;
    s.meta_bytes += l.meta_bytes;
    s.routed_pairs += l.routed_pairs;
    s.local_pairs += l.local_pairs;
  }
  return s;
}

// ---------------------------------------------------------------------------------- the rank

class DslpRank::Impl final : public DistributedHooks {
 public:
  Impl(Engine& engine, Collective& comm, const DslpOptions& options)
      : engine_(engine),
        comm_(comm),
        options_(options),
        config_(engine.config()),
        dev_(engine.device()),
        rank_(comm.rank()),
        world_(comm.world_size()) {
    hidden_ = config_.hidden_size;
    num_experts_ = config_.n_routed_experts;
    top_k_ = num_experts_ > 0 ? config_.num_experts_per_tok : 0;
    expert_begin_ = FirstExpertOfRank(num_experts_, world_, rank_);
    expert_end_ = FirstExpertOfRank(num_experts_, world_, rank_ + 1);
  }

  absl::Status Init(MicroBatch* batch) {
    if (num_experts_ > 0 && num_experts_ < world_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dslp: ", num_experts_, " routed experts cannot be split over ", world_, " ranks"));
    }
    if (batch != nullptr) {
      batch_ = batch;
      return absl::OkStatus();
    }
    HMOE_ASSIGN_OR_RETURN(owned_batch_, engine_.NewMicroBatch());
    batch_ = owned_batch_.get();
    return absl::OkStatus();
  }

  absl::StatusOr<DslpResult> Prefill(std::span<const int32_t> prompt, KvSequence& sequence);

  absl::Status Attention(const AttentionHookArgs& a) override;
  absl::Status Route(const RouteHookArgs& a) override;
  absl::Status Moe(const MoeHookArgs& a) override;

  const DslpStats& stats() const { return stats_; }
  int rank() const { return rank_; }
  int world() const { return world_; }

 private:
  // Adds the bytes sent to each peer since `before` to `per_peer`; returns their sum.
  uint64_t Account(const CommCounters& before, std::vector<uint64_t>* per_peer) const {
    const CommCounters d = comm_.counters().Minus(before);
    for (size_t p = 0; p < d.bytes_sent.size() && p < per_peer->size(); ++p) {
      (*per_peer)[p] += d.bytes_sent[p];
    }
    return d.total_sent();
  }
  absl::Status Run(std::span<const int32_t> prompt, KvSequence& sequence, DslpResult* result);
  // out[dst_rows[i]] += dst_weights[i] * MLP(in[i]) for i < rows (device row lists).
  absl::Status Mlp(Stream& st, const MlpWeights& m, const float* in, int64_t rows,
                   const int32_t* dst_rows, const float* dst_weights, float* out);
  // delta[t] = shared experts (x[t]) for t < n, or 0 without shared experts.
  absl::Status SharedExperts(int64_t layer, Stream& st, const float* x, int64_t n, float* delta);
  // Runs the local experts over `rows` of `x` grouped by expert (rows_of[e - expert_begin_],
  // host lists of row indices with weights), adding weighted results into `out`.
  absl::Status LocalExperts(int64_t layer, Stream& st, const float* x,
                            const std::vector<std::vector<int32_t>>& rows_of,
                            const std::vector<std::vector<float>>& weights_of, float* out);
  absl::Status MoeStandard(const MoeHookArgs& a);
  absl::Status MoeSmallEp(const MoeHookArgs& a);
  // All-to-all of int64 values (one per peer) through device memory.
  absl::Status ExchangeCounts(Stream& st, const std::vector<int64_t>& send,
                              std::vector<int64_t>* recv);

  Engine& engine_;
  Collective& comm_;
  const DslpOptions options_;
  const ModelConfig& config_;
  Device& dev_;
  const int rank_;
  const int world_;
  int64_t hidden_ = 0, num_experts_ = 0, top_k_ = 0, expert_begin_ = 0, expert_end_ = 0;
  std::unique_ptr<MicroBatch> owned_batch_;
  MicroBatch* batch_ = nullptr;

  // The current prefill.
  std::optional<ZigZagPlan> plan_;
  std::vector<int64_t> rank_tokens_;   // tokens per rank
  std::vector<int64_t> rank_offsets_;  // first row of each rank in rank-major order
  std::vector<int32_t> local_positions_, all_positions_;  // this rank's; every rank's, rank-major
  int64_t max_rank_tokens_ = 0;
  DslpStats stats_;
  double route_s_ = 0, moe_s_ = 0;  // hook time inside RunAttention / RunFfn, per layer

  // Device buffers.
  GrowingBuffer slots_;  // int32 [N]: cache slots of every rank's tokens, rank-major
  GrowingBuffer state_u_, state_lse_, ring_[2];
  GrowingBuffer x_all_, ids_all_, w_all_, partial_, recv_partial_;  // SmallEP
  GrowingBuffer send_rows_, recv_rows_, y_rows_, back_rows_, pair_rows_, pair_weights_;
  GrowingBuffer pair_experts_, recv_experts_, meta_;  // standard EP
  GrowingBuffer expert_rows_, expert_weights_, identity_, ones_;
  GrowingBuffer xg_, g_, u_, yg_;
  // Host scratch.
  std::vector<int32_t> host_ids_;
  std::vector<float> host_weights_;
};

absl::StatusOr<DslpResult> DslpRank::Impl::Prefill(std::span<const int32_t> prompt,
                                                   KvSequence& sequence) {
  if (sequence.num_tokens() != 0) {
    return absl::FailedPreconditionError("dslp: the KV sequence is not empty");
  }
  DslpResult result;
  absl::Status s = Run(prompt, sequence, &result);
  plan_.reset();
  if (!s.ok()) {
    batch_->AbandonStep();
    sequence.Reset();
    return s;
  }
  return result;
}

absl::Status DslpRank::Impl::Run(std::span<const int32_t> prompt, KvSequence& sequence,
                                 DslpResult* result) {
  const absl::Time start = absl::Now();
  const int64_t total = static_cast<int64_t>(prompt.size());
  HMOE_ASSIGN_OR_RETURN(ZigZagPlan plan, ZigZagPlan::Make(total, world_));
  plan_ = plan;
  const int64_t layers = config_.num_hidden_layers;
  stats_ = DslpStats();
  stats_.rank = rank_;
  stats_.world_size = world_;
  stats_.ep_mode = options_.ep_mode;
  stats_.prompt_tokens = total;
  stats_.layers.assign(layers, DslpLayerStats());
  for (auto* v :
       {&stats_.ring_sent, &stats_.dispatch_sent, &stats_.combine_sent, &stats_.meta_sent}) {
    v->assign(world_, 0);
  }
  const CommCounters comm_before = comm_.counters();

  rank_tokens_.assign(world_, 0);
  rank_offsets_.assign(world_, 0);
  max_rank_tokens_ = 0;
  for (int p = 0; p < world_; ++p) {
    rank_tokens_[p] = plan.tokens_of(p);
    if (p > 0) rank_offsets_[p] = rank_offsets_[p - 1] + rank_tokens_[p - 1];
    max_rank_tokens_ = std::max(max_rank_tokens_, rank_tokens_[p]);
  }
  const std::vector<int32_t> positions = plan.positions_of(rank_);
  local_positions_ = positions;
  all_positions_.clear();
  for (int p = 0; p < world_; ++p) {
    const std::vector<int32_t> of = plan.positions_of(p);
    all_positions_.insert(all_positions_.end(), of.begin(), of.end());
  }
  std::vector<int32_t> tokens;
  tokens.reserve(positions.size());
  for (int32_t p : positions) tokens.push_back(prompt[p]);
  const int64_t n = static_cast<int64_t>(tokens.size());
  stats_.local_tokens = n;

  // Fail fast (and in step) when the group is not whole.
  HMOE_RETURN_IF_ERROR(comm_.Barrier());

  DistributedStepInput in;
  in.sequence = &sequence;
  in.total_tokens = total;
  in.tokens = tokens;
  in.positions = positions;
  in.want_logits = plan.chunk_end(plan.second_chunk(rank_)) == total;  // rank 0
  in.hooks = this;
  HMOE_RETURN_IF_ERROR(batch_->BeginDistributedStep(in));

  // Cache slots of every rank's tokens (the sequence's blocks are reserved now), rank-major.
  Stream& st = batch_->stream();
  {
    const int64_t bs = sequence.cache()->config().block_size;
    const std::vector<int32_t>& table = sequence.block_table();
    std::vector<int32_t> slots;
    slots.reserve(total);
    for (int p = 0; p < world_; ++p) {
      for (int32_t pos : plan.positions_of(p)) {
        slots.push_back(static_cast<int32_t>(table[pos / bs] * bs + pos % bs));
      }
    }
    HMOE_ASSIGN_OR_RETURN(int32_t * dev_slots, slots_.Get<int32_t>(dev_, total));
    HMOE_RETURN_IF_ERROR(
        dev_.CopyToDevice(st, dev_slots, slots.data(), slots.size() * sizeof(int32_t)));
  }

  for (int64_t l = 0; l < layers; ++l) {
    // Relaxed: a flag polled between layers; a late sighting only delays the cancel.
    if (options_.cancelled != nullptr && options_.cancelled->load(std::memory_order_relaxed)) {
      return absl::CancelledError(absl::StrCat("dslp: prefill cancelled before layer ", l));
    }
    DslpLayerStats& ls = stats_.layers[l];
    route_s_ = 0;
    moe_s_ = 0;
    absl::Time t = absl::Now();
    HMOE_RETURN_IF_ERROR(batch_->RunAttention(l));
    ls.attention_other_s = Since(t) - ls.attention_local_s - ls.ring_s - ls.attention_remote_s -
                           ls.attention_project_s - route_s_;
    t = absl::Now();
    HMOE_RETURN_IF_ERROR(batch_->RunFfn(l));
    ls.ffn_other_s = Since(t) - moe_s_;
  }
  HMOE_ASSIGN_OR_RETURN(std::vector<std::vector<float>> logits, batch_->FinishStep());
  if (in.want_logits) result->logits = std::move(logits[0]);
  stats_.comm = comm_.counters().Minus(comm_before);
  stats_.total_s = Since(start);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------- attention

absl::Status DslpRank::Impl::Attention(const AttentionHookArgs& a) {
  DslpLayerStats& ls = stats_.layers[a.layer];
  Stream& st = *a.stream;
  const ZigZagPlan& plan = *plan_;
  const MlaDimensions& d = a.dims;
  const int64_t rkv = d.kv_lora_rank;
  const int64_t row = rkv + d.rope_dim;
  const int64_t n = a.num_tokens;
  if (a.kv_stride != row || n != rank_tokens_[rank_]) {
    return absl::InternalError("dslp attention: unexpected KV layout or token count");
  }
  const int ca = plan.first_chunk(rank_), cb = plan.second_chunk(rank_);
  const int64_t na = plan.chunk_end(ca) - plan.chunk_begin(ca);
  const MlaSegment seg_a{0, na, plan.chunk_begin(ca), 0};
  const MlaSegment seg_b{na, n - na, plan.chunk_begin(cb), 0};
  auto keys = [&](int c) { return MlaKeyRange{plan.chunk_begin(c), plan.chunk_end(c)}; };

  HMOE_ASSIGN_OR_RETURN(float* u, state_u_.Get<float>(dev_, n * d.num_heads * rkv));
  HMOE_ASSIGN_OR_RETURN(float* lse, state_lse_.Get<float>(dev_, n * d.num_heads));
  MlaAttentionArgs args;
  args.dims = d;
  args.q = a.q;
  args.q_stride = a.q_stride;
  args.w_uk_t = a.weights->w_uk_t;
  args.cache = a.cache;
  args.block_tables = a.block_table;
  MlaPartialState state;
  state.u = u;
  state.lse = lse;
  auto attend = [&](std::initializer_list<MlaSegment> segments,
                    std::initializer_list<MlaKeyRange> ranges, bool first) {
    const std::vector<MlaSegment> segs(segments);
    const std::vector<MlaKeyRange> rngs(ranges);
    args.segments = segs;
    args.key_ranges = rngs;
    state.first = first;
    return dev_.MlaAttentionPartial(st, args, state);
  };

  // Phase 1: the local chunks (their KV was written by the engine). Chunk a is entirely before
  // chunk b: b's queries see all of it.
  absl::Time t = absl::Now();
  HMOE_RETURN_IF_ERROR(attend({seg_a, seg_b}, {keys(ca), keys(cb)}, /*first=*/true));
  HMOE_RETURN_IF_ERROR(attend({seg_b}, {keys(ca)}, /*first=*/false));
  ls.attention_local_s += Since(t);

  // Phase 2: pass-KV around the ring. At step j this rank receives the chunks of rank
  // (rank - j) mod S, writes them into its cache, and attends where causality allows: rank src
  // holds chunks src and 2S-1-src; chunk src is before both local chunks when src < rank (all of
  // it visible to both), otherwise before chunk b only; chunk 2S-1-src is before chunk b when
  // src > rank and after both local chunks otherwise.
  const float* send = a.kv;
  int64_t send_tokens = n;
  HMOE_ASSIGN_OR_RETURN(const int32_t* slots, slots_.Get<int32_t>(dev_, plan.num_tokens()));
  for (int j = 1; j < world_; ++j) {
    const int src = (rank_ - j + world_) % world_;
    const int64_t n_src = rank_tokens_[src];
    HMOE_ASSIGN_OR_RETURN(float* recv, ring_[j % 2].Get<float>(dev_, max_rank_tokens_ * row));
    t = absl::Now();
    const CommCounters before = comm_.counters();
    HMOE_RETURN_IF_ERROR(comm_.RingSendRecv(st, send, send_tokens * row * sizeof(float), recv,
                                            n_src * row * sizeof(float)));
    HMOE_RETURN_IF_ERROR(dev_.KvCacheWrite(st, a.cache, slots + rank_offsets_[src], n_src, recv,
                                           row, recv + rkv, row, rkv));
    ls.ring_bytes += Account(before, &stats_.ring_sent);
    ls.ring_s += Since(t);
    t = absl::Now();
    const int sa = plan.first_chunk(src), sb = plan.second_chunk(src);
    if (src < rank_) {
      HMOE_RETURN_IF_ERROR(attend({seg_a, seg_b}, {keys(sa), keys(sa)}, /*first=*/false));
    } else {
      HMOE_RETURN_IF_ERROR(attend({seg_b}, {keys(sa)}, /*first=*/false));
      HMOE_RETURN_IF_ERROR(attend({seg_b}, {keys(sb)}, /*first=*/false));
    }
    ls.attention_remote_s += Since(t);
    send = recv;
    send_tokens = n_src;
  }

  t = absl::Now();
  HMOE_RETURN_IF_ERROR(dev_.MlaProjectLatent(st, d, a.weights->kv_b, u, n, a.out, a.out_stride));
  ls.attention_project_s += Since(t);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------- MoE

absl::Status DslpRank::Impl::Route(const RouteHookArgs& a) {
  const absl::Time start = absl::Now();
  DslpLayerStats& ls = stats_.layers[a.layer];
  Stream& st = *a.stream;
  if (options_.ep_mode == EpMode::kStandard) {
    absl::Time t = absl::Now();
    HMOE_RETURN_IF_ERROR(dev_.MoeGate(st, a.x, hidden_, a.num_tokens, *a.router, *a.router_bias,
                                      a.params, a.ids, a.weights));
    ls.gate_sort_s += Since(t);
  } else {
    // SmallEP: all-gather the unsorted tokens, then gate the whole batch.
    const int64_t total = plan_->num_tokens();
    HMOE_ASSIGN_OR_RETURN(float* x_all, x_all_.Get<float>(dev_, total * hidden_));
    HMOE_ASSIGN_OR_RETURN(int32_t * ids, ids_all_.Get<int32_t>(dev_, total * top_k_));
    HMOE_ASSIGN_OR_RETURN(float* weights, w_all_.Get<float>(dev_, total * top_k_));
    const Layout layout = Layout::Rows(rank_tokens_, hidden_ * sizeof(float));
    absl::Time t = absl::Now();
    const CommCounters before = comm_.counters();
    HMOE_RETURN_IF_ERROR(comm_.AllGatherV(st, a.x, x_all, layout.counts, layout.offsets));
    ls.dispatch_bytes += Account(before, &stats_.dispatch_sent);
    ls.dispatch_s += Since(t);
    t = absl::Now();
    HMOE_RETURN_IF_ERROR(
        dev_.MoeGate(st, x_all, hidden_, total, *a.router, *a.router_bias, a.params, ids, weights));
    ls.gate_sort_s += Since(t);
  }
  route_s_ += Since(start);
  return absl::OkStatus();
}

absl::Status DslpRank::Impl::Moe(const MoeHookArgs& a) {
  const absl::Time start = absl::Now();
  absl::Status s = options_.ep_mode == EpMode::kStandard ? MoeStandard(a) : MoeSmallEp(a);
  moe_s_ += Since(start);
  return s;
}

absl::Status DslpRank::Impl::Mlp(Stream& st, const MlpWeights& m, const float* in, int64_t rows,
                                 const int32_t* dst_rows, const float* dst_weights, float* out) {
  const int64_t inter = m.gate.rows;
  HMOE_ASSIGN_OR_RETURN(float* g, g_.Get<float>(dev_, rows * inter));
  HMOE_ASSIGN_OR_RETURN(float* u, u_.Get<float>(dev_, rows * inter));
  HMOE_ASSIGN_OR_RETURN(float* yg, yg_.Get<float>(dev_, rows * hidden_));
  // The engine's grouped expert MLP (engine.cc RunGroupedExperts), op for op.
  HMOE_RETURN_IF_ERROR(dev_.Linear(st, m.gate, in, hidden_, rows, g, inter));
  HMOE_RETURN_IF_ERROR(dev_.Linear(st, m.up, in, hidden_, rows, u, inter));
  HMOE_RETURN_IF_ERROR(dev_.SiluMul(st, g, u, rows * inter, g));
  HMOE_RETURN_IF_ERROR(dev_.Linear(st, m.down, g, inter, rows, yg, hidden_));
  return dev_.ScatterAddRows(st, yg, hidden_, dst_rows, dst_weights, rows, hidden_, out, hidden_);
}

absl::Status DslpRank::Impl::SharedExperts(int64_t layer, Stream& st, const float* x, int64_t n,
                                           float* delta) {
  HMOE_RETURN_IF_ERROR(dev_.Memset(st, delta, 0, static_cast<size_t>(n * hidden_) * sizeof(float)));
  if (config_.n_shared_experts <= 0) return absl::OkStatus();
  WeightProvider& wp = engine_.weights();
  const ModuleId id{ModuleKind::kSharedExperts, static_cast<int32_t>(layer), -1};
  HMOE_ASSIGN_OR_RETURN(const ModuleWeights* mw, wp.Acquire(id, st));
  std::vector<int32_t> identity(n);
  for (int64_t t = 0; t < n; ++t) identity[t] = static_cast<int32_t>(t);
  const std::vector<float> ones(n, 1.0f);
  HMOE_ASSIGN_OR_RETURN(int32_t * rows, identity_.Get<int32_t>(dev_, n));
  HMOE_ASSIGN_OR_RETURN(float* weights, ones_.Get<float>(dev_, n));
  HMOE_RETURN_IF_ERROR(dev_.CopyToDevice(st, rows, identity.data(), n * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(dev_.CopyToDevice(st, weights, ones.data(), n * sizeof(float)));
  HMOE_RETURN_IF_ERROR(Mlp(st, mw->mlp, x, n, rows, weights, delta));
  HMOE_RETURN_IF_ERROR(wp.Release(id, st));
  // The identity/ones uploads must not be overwritten before the device has used them.
  return st.Synchronize();
}

absl::Status DslpRank::Impl::LocalExperts(int64_t layer, Stream& st, const float* x,
                                          const std::vector<std::vector<int32_t>>& rows_of,
                                          const std::vector<std::vector<float>>& weights_of,
                                          float* out) {
  WeightProvider& wp = engine_.weights();
  // All row lists in one upload, expert by expert.
  std::vector<int32_t> rows;
  std::vector<float> weights;
  std::vector<int64_t> begin;
  int64_t max_rows = 0;
  for (size_t i = 0; i < rows_of.size(); ++i) {
    begin.push_back(static_cast<int64_t>(rows.size()));
    rows.insert(rows.end(), rows_of[i].begin(), rows_of[i].end());
    weights.insert(weights.end(), weights_of[i].begin(), weights_of[i].end());
    max_rows = std::max<int64_t>(max_rows, static_cast<int64_t>(rows_of[i].size()));
  }
  HMOE_ASSIGN_OR_RETURN(int32_t * dev_rows, expert_rows_.Get<int32_t>(dev_, rows.size()));
  HMOE_ASSIGN_OR_RETURN(float* dev_weights, expert_weights_.Get<float>(dev_, weights.size()));
  HMOE_ASSIGN_OR_RETURN(float* xg, xg_.Get<float>(dev_, max_rows * hidden_));
  HMOE_RETURN_IF_ERROR(dev_.CopyToDevice(st, dev_rows, rows.data(), rows.size() * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(
      dev_.CopyToDevice(st, dev_weights, weights.data(), weights.size() * sizeof(float)));
  for (int64_t e = expert_begin_; e < expert_end_; ++e) {
    // Every local expert is acquired, in increasing id order (a streaming provider advances).
    const ModuleId id{ModuleKind::kRoutedExpert, static_cast<int32_t>(layer),
                      static_cast<int32_t>(e)};
    HMOE_ASSIGN_OR_RETURN(const ModuleWeights* mw, wp.Acquire(id, st));
    const int64_t i = e - expert_begin_;
    const int64_t count = static_cast<int64_t>(rows_of[i].size());
    if (count > 0) {
      HMOE_RETURN_IF_ERROR(
          dev_.GatherRows(st, x, hidden_, dev_rows + begin[i], count, hidden_, xg, hidden_));
      HMOE_RETURN_IF_ERROR(
          Mlp(st, mw->mlp, xg, count, dev_rows + begin[i], dev_weights + begin[i], out));
    }
    HMOE_RETURN_IF_ERROR(wp.Release(id, st));
  }
  return st.Synchronize();  // the host row lists are released when this returns
}

absl::Status DslpRank::Impl::ExchangeCounts(Stream& st, const std::vector<int64_t>& send,
                                            std::vector<int64_t>* recv) {
  HMOE_ASSIGN_OR_RETURN(int64_t * buf, meta_.Get<int64_t>(dev_, 2 * world_));
  HMOE_RETURN_IF_ERROR(dev_.CopyToDevice(st, buf, send.data(), world_ * sizeof(int64_t)));
  const std::vector<int64_t> ones(world_, 1);
  const Layout layout = Layout::Rows(ones, sizeof(int64_t));
  HMOE_RETURN_IF_ERROR(comm_.AllToAllV(st, buf, layout.counts, layout.offsets, buf + world_,
                                       layout.counts, layout.offsets));
  recv->assign(world_, 0);
  HMOE_RETURN_IF_ERROR(dev_.CopyToHost(st, recv->data(), buf + world_, world_ * sizeof(int64_t)));
  return st.Synchronize();
}

// Standard EP: gate and sort locally, dispatch one hidden row per (token, expert) pair to the
// expert's owner, run the local experts, send the outputs back, weighted sum at home.
absl::Status DslpRank::Impl::MoeStandard(const MoeHookArgs& a) {
  DslpLayerStats& ls = stats_.layers[a.layer];
  Stream& st = *a.stream;
  const int64_t n = a.num_tokens;
  const int64_t k = top_k_;
  const int64_t row_bytes = hidden_ * sizeof(float);

  // Sort the local pairs by expert (hence by destination rank: experts are owned in contiguous
  // ranges), tokens ascending within an expert.
  absl::Time t = absl::Now();
  host_ids_.resize(n * k);
  host_weights_.resize(n * k);
  HMOE_RETURN_IF_ERROR(dev_.CopyToHost(st, host_ids_.data(), a.ids, n * k * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(dev_.CopyToHost(st, host_weights_.data(), a.weights, n * k * sizeof(float)));
  HMOE_RETURN_IF_ERROR(st.Synchronize());
  std::vector<int64_t> per_expert(num_experts_ + 1, 0);
  for (int64_t i = 0; i < n * k; ++i) ++per_expert[host_ids_[i] + 1];
  for (int64_t e = 0; e < num_experts_; ++e) per_expert[e + 1] += per_expert[e];
  const int64_t pairs = n * k;
  std::vector<int32_t> pair_token(pairs), pair_expert(pairs);
  std::vector<float> pair_weight(pairs);
  {
    std::vector<int64_t> fill(per_expert.begin(), per_expert.end() - 1);
    for (int64_t tok = 0; tok < n; ++tok) {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = host_ids_[tok * k + j];
        const int64_t at = fill[e]++;
        pair_token[at] = static_cast<int32_t>(tok);
        pair_expert[at] = e;
        pair_weight[at] = host_weights_[tok * k + j];
      }
    }
  }
  std::vector<int64_t> send_pairs(world_, 0);
  for (int p = 0; p < world_; ++p) {
    send_pairs[p] = per_expert[FirstExpertOfRank(num_experts_, world_, p + 1)] -
                    per_expert[FirstExpertOfRank(num_experts_, world_, p)];
  }
  ls.local_pairs += send_pairs[rank_];
  if (options_.routing_observer) {
    options_.routing_observer(a.layer, local_positions_, k, host_ids_.data());
  }
  ls.gate_sort_s += Since(t);

  // Shared experts of the local tokens first (the engine's order of modules and of the sum).
  t = absl::Now();
  HMOE_RETURN_IF_ERROR(SharedExperts(a.layer, st, a.x, n, a.delta));
  ls.shared_s += Since(t);

  // Dispatch: pair counts, expert ids, hidden rows.
  t = absl::Now();
  CommCounters before = comm_.counters();
  std::vector<int64_t> recv_pairs;
  HMOE_RETURN_IF_ERROR(ExchangeCounts(st, send_pairs, &recv_pairs));
  int64_t received = 0;
  for (int64_t c : recv_pairs) received += c;
  HMOE_ASSIGN_OR_RETURN(int32_t * dev_pair_experts, pair_experts_.Get<int32_t>(dev_, pairs));
  HMOE_ASSIGN_OR_RETURN(int32_t * dev_recv_experts, recv_experts_.Get<int32_t>(dev_, received));
  HMOE_RETURN_IF_ERROR(
      dev_.CopyToDevice(st, dev_pair_experts, pair_expert.data(), pairs * sizeof(int32_t)));
  const Layout send_ids = Layout::Rows(send_pairs, sizeof(int32_t));
  const Layout recv_ids = Layout::Rows(recv_pairs, sizeof(int32_t));
  HMOE_RETURN_IF_ERROR(comm_.AllToAllV(st, dev_pair_experts, send_ids.counts, send_ids.offsets,
                                       dev_recv_experts, recv_ids.counts, recv_ids.offsets));
  std::vector<int32_t> recv_expert(received);
  HMOE_RETURN_IF_ERROR(
      dev_.CopyToHost(st, recv_expert.data(), dev_recv_experts, received * sizeof(int32_t)));
  ls.meta_bytes += Account(before, &stats_.meta_sent);
  HMOE_ASSIGN_OR_RETURN(int32_t * dev_pair_rows, pair_rows_.Get<int32_t>(dev_, pairs));
  HMOE_ASSIGN_OR_RETURN(float* dev_pair_weights, pair_weights_.Get<float>(dev_, pairs));
  HMOE_ASSIGN_OR_RETURN(float* send_rows, send_rows_.Get<float>(dev_, pairs * hidden_));
  HMOE_ASSIGN_OR_RETURN(float* recv_rows, recv_rows_.Get<float>(dev_, received * hidden_));
  HMOE_RETURN_IF_ERROR(
      dev_.CopyToDevice(st, dev_pair_rows, pair_token.data(), pairs * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(
      dev_.CopyToDevice(st, dev_pair_weights, pair_weight.data(), pairs * sizeof(float)));
  HMOE_RETURN_IF_ERROR(
      dev_.GatherRows(st, a.x, hidden_, dev_pair_rows, pairs, hidden_, send_rows, hidden_));
  const Layout send_layout = Layout::Rows(send_pairs, row_bytes);
  const Layout recv_layout = Layout::Rows(recv_pairs, row_bytes);
  before = comm_.counters();
  HMOE_RETURN_IF_ERROR(comm_.AllToAllV(st, send_rows, send_layout.counts, send_layout.offsets,
                                       recv_rows, recv_layout.counts, recv_layout.offsets));
  ls.dispatch_bytes += Account(before, &stats_.dispatch_sent);
  HMOE_RETURN_IF_ERROR(st.Synchronize());  // recv_expert is read below
  ls.dispatch_s += Since(t);

  // Local experts over the received rows; each row's output lands in the same row of y (weight
  // 1 onto zeros: an exact copy).
  t = absl::Now();
  std::vector<std::vector<int32_t>> rows_of(expert_end_ - expert_begin_);
  std::vector<std::vector<float>> weights_of(expert_end_ - expert_begin_);
  for (int64_t i = 0; i < received; ++i) {
    const int64_t e = recv_expert[i];
    if (e < expert_begin_ || e >= expert_end_) {
      return absl::InternalError(absl::StrCat("dslp: rank ", rank_, " received a token for expert ",
                                              e, ", not one of its own"));
    }
    rows_of[e - expert_begin_].push_back(static_cast<int32_t>(i));
    weights_of[e - expert_begin_].push_back(1.0f);
  }
  HMOE_ASSIGN_OR_RETURN(float* y_rows, y_rows_.Get<float>(dev_, received * hidden_));
  HMOE_RETURN_IF_ERROR(
      dev_.Memset(st, y_rows, 0, static_cast<size_t>(received * hidden_) * sizeof(float)));
  HMOE_RETURN_IF_ERROR(LocalExperts(a.layer, st, recv_rows, rows_of, weights_of, y_rows));
  ls.routed_pairs += received;
  ls.experts_s += Since(t);

  // Combine: the outputs go back to the tokens' ranks, in the order they came.
  t = absl::Now();
  HMOE_ASSIGN_OR_RETURN(float* back_rows, back_rows_.Get<float>(dev_, pairs * hidden_));
  before = comm_.counters();
  HMOE_RETURN_IF_ERROR(comm_.AllToAllV(st, y_rows, recv_layout.counts, recv_layout.offsets,
                                       back_rows, send_layout.counts, send_layout.offsets));
  ls.combine_bytes += Account(before, &stats_.combine_sent);
  ls.combine_s += Since(t);

  // The routed outputs weighted onto the shared experts' result, in increasing expert id per
  // token.
  t = absl::Now();
  HMOE_RETURN_IF_ERROR(dev_.ScatterAddRows(st, back_rows, hidden_, dev_pair_rows, dev_pair_weights,
                                           pairs, hidden_, a.delta, hidden_));
  HMOE_RETURN_IF_ERROR(st.Synchronize());
  ls.reduce_s += Since(t);
  return absl::OkStatus();
}

// SmallEP: the tokens were all-gathered and gated in Route; keep the pairs of local experts,
// partial weighted sums over all N rows, all-to-all of the partial sums, local reduction.
absl::Status DslpRank::Impl::MoeSmallEp(const MoeHookArgs& a) {
  DslpLayerStats& ls = stats_.layers[a.layer];
  Stream& st = *a.stream;
  const int64_t n = a.num_tokens;
  const int64_t total = plan_->num_tokens();
  const int64_t k = top_k_;
  HMOE_ASSIGN_OR_RETURN(float* x_all, x_all_.Get<float>(dev_, total * hidden_));
  HMOE_ASSIGN_OR_RETURN(int32_t * ids, ids_all_.Get<int32_t>(dev_, total * k));
  HMOE_ASSIGN_OR_RETURN(float* weights, w_all_.Get<float>(dev_, total * k));

  absl::Time t = absl::Now();
  host_ids_.resize(total * k);
  host_weights_.resize(total * k);
  HMOE_RETURN_IF_ERROR(dev_.CopyToHost(st, host_ids_.data(), ids, total * k * sizeof(int32_t)));
  HMOE_RETURN_IF_ERROR(
      dev_.CopyToHost(st, host_weights_.data(), weights, total * k * sizeof(float)));
  HMOE_RETURN_IF_ERROR(st.Synchronize());
  if (options_.routing_observer) {
    options_.routing_observer(a.layer, all_positions_, k, host_ids_.data());
  }
  std::vector<std::vector<int32_t>> rows_of(expert_end_ - expert_begin_);
  std::vector<std::vector<float>> weights_of(expert_end_ - expert_begin_);
  int64_t kept = 0;
  for (int64_t row = 0; row < total; ++row) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = host_ids_[row * k + j];
      if (e < expert_begin_ || e >= expert_end_) continue;  // another rank's expert
      rows_of[e - expert_begin_].push_back(static_cast<int32_t>(row));
      weights_of[e - expert_begin_].push_back(host_weights_[row * k + j]);
      ++kept;
      if (row >= rank_offsets_[rank_] && row < rank_offsets_[rank_] + n) ++ls.local_pairs;
    }
  }
  ls.gate_sort_s += Since(t);

  // Shared experts of the local tokens first (the engine's order of modules and of the sum).
  t = absl::Now();
  HMOE_RETURN_IF_ERROR(SharedExperts(a.layer, st, a.x, n, a.delta));
  ls.shared_s += Since(t);

  t = absl::Now();
  HMOE_ASSIGN_OR_RETURN(float* partial, partial_.Get<float>(dev_, total * hidden_));
  HMOE_RETURN_IF_ERROR(
      dev_.Memset(st, partial, 0, static_cast<size_t>(total * hidden_) * sizeof(float)));
  HMOE_RETURN_IF_ERROR(LocalExperts(a.layer, st, x_all, rows_of, weights_of, partial));
  ls.routed_pairs += kept;
  ls.experts_s += Since(t);

  // Rank p gets the partial sums of its own rows; this rank gets S partials of its rows.
  t = absl::Now();
  HMOE_ASSIGN_OR_RETURN(float* recv, recv_partial_.Get<float>(dev_, world_ * n * hidden_));
  const Layout send_layout = Layout::Rows(rank_tokens_, hidden_ * sizeof(float));
  const Layout recv_layout = Layout::Rows(std::vector<int64_t>(world_, n), hidden_ * sizeof(float));
  const CommCounters before = comm_.counters();
  HMOE_RETURN_IF_ERROR(comm_.AllToAllV(st, partial, send_layout.counts, send_layout.offsets, recv,
                                       recv_layout.counts, recv_layout.offsets));
  ls.combine_bytes += Account(before, &stats_.combine_sent);
  ls.combine_s += Since(t);

  // Local reduction: the partials in rank order onto the shared experts' result.
  t = absl::Now();
  for (int q = 0; q < world_; ++q) {
    HMOE_RETURN_IF_ERROR(dev_.Add(st, a.delta, recv + q * n * hidden_, n * hidden_, a.delta));
  }
  HMOE_RETURN_IF_ERROR(st.Synchronize());
  ls.reduce_s += Since(t);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------- DslpRank

DslpRank::DslpRank(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DslpRank::~DslpRank() = default;

absl::StatusOr<std::unique_ptr<DslpRank>> DslpRank::Create(Engine& engine, Collective& comm,
                                                           const DslpOptions& options,
                                                           MicroBatch* batch) {
  auto impl = std::make_unique<Impl>(engine, comm, options);
  HMOE_RETURN_IF_ERROR(impl->Init(batch));
  return std::unique_ptr<DslpRank>(new DslpRank(std::move(impl)));
}

absl::StatusOr<DslpResult> DslpRank::Prefill(std::span<const int32_t> prompt,
                                             KvSequence& sequence) {
  return impl_->Prefill(prompt, sequence);
}

const DslpStats& DslpRank::last_stats() const { return impl_->stats(); }
int DslpRank::rank() const { return impl_->rank(); }
int DslpRank::world_size() const { return impl_->world(); }

}  // namespace hmoe

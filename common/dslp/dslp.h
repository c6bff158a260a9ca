#pragma once

// Distributed stream-loading prefill (DSLP, paper §2.2.3 and §3.2): S ranks (prefill workers, one
// device each) prefill one prompt together. Each rank runs the engine's forward pass
// (MicroBatch::BeginDistributedStep) over its share of the prompt and plugs in the three parts
// that need the other ranks (engine.h DistributedHooks):
//
// - Context parallelism, zig-zag (load-balanced striped attention): the prompt is cut into 2S
//   chunks and rank r gets chunks r and 2S-1-r. Attention runs in two phases: phase 1 attends the
//   rank's queries to its own chunks' KV; phase 2 passes KV around the ring S-1 times (pass-KV,
//   the latent MLA cache rows: kv_lora_rank + rope_dim floats per token and layer) and attends to
//   each received chunk where causality allows. The partial results are merged with the online
//   softmax (Device::MlaAttentionPartial) and projected once (Device::MlaProjectLatent). Every
//   rank writes each received chunk into its cache, so after the step every rank holds the whole
//   prompt's KV cache (rank 0 hands it off).
// - Expert parallelism, two modes (EpMode):
//   kStandard: gate and sort the local tokens, all-to-all dispatch of one hidden row per (token,
//     expert) pair to the expert's owner, local experts, all-to-all combine of the expert outputs
//     back to the token's rank, weighted sum there (shared experts, then routed experts in
//     increasing id: the single-process order, so this mode's MoE output equals the engine's
//     bit for bit for the same input).
//   kSmallEp: all-gather the unsorted tokens, every rank gates the full batch and keeps the pairs
//     of its local experts, a per-rank partial weighted sum into an [N, hidden] tensor, all-to-all
//     of the partial results (rank p receives the rows of its tokens), local reduction (shared
//     experts, then the partials in rank order).
//   Rank r owns the contiguous experts [r E / S, (r + 1) E / S) and acquires (stream-loads under
//   SLP) only those, in increasing order; shared experts, dense layers, attention weights and the
//   head are needed on every rank.
//
// The prompt's last token lies in chunk 2S-1, i.e. on rank 0, which returns its logits.
//
// Requirements: the engine's device is the collective's device (host memory for ShmCollective);
// every rank calls Prefill with the same prompt; the prompt has at least 2S tokens; the local
// tokens fit one engine step (EngineOptions::max_step_tokens).
//
// Thread-compatibility: a DslpRank is driven by one thread.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "common/comm/collective.h"
#include "common/engine/engine.h"
#include "common/engine/kv_cache.h"

namespace hmoe {

enum class EpMode { kStandard, kSmallEp };

// "standard" / "small_ep".
const char* EpModeName(EpMode mode);
// Accepts "standard" and "small_ep" (also "smallep"); InvalidArgument otherwise.
absl::StatusOr<EpMode> ParseEpMode(absl::string_view name);

// The zig-zag split of a prompt of num_tokens tokens over world_size ranks: 2S chunks of
// num_tokens / 2S tokens, the first num_tokens % 2S chunks one longer; rank r holds chunks r and
// 2S-1-r.
class ZigZagPlan {
 public:
  // InvalidArgument when num_tokens < 2 * world_size or world_size < 1.
  static absl::StatusOr<ZigZagPlan> Make(int64_t num_tokens, int world_size);

  int64_t num_tokens() const { return num_tokens_; }
  int world_size() const { return world_size_; }
  // Chunk c covers positions [chunk_begin(c), chunk_end(c)).
  int64_t chunk_begin(int c) const { return bounds_[c]; }
  int64_t chunk_end(int c) const { return bounds_[c + 1]; }
  // The rank's two chunks, in position order: r and 2S-1-r.
  int first_chunk(int rank) const { return rank; }
  int second_chunk(int rank) const { return 2 * world_size_ - 1 - rank; }
  int64_t tokens_of(int rank) const;
  // Positions of the rank's tokens (its first chunk, then its second).
  std::vector<int32_t> positions_of(int rank) const;

 private:
  int64_t num_tokens_ = 0;
  int world_size_ = 1;
  std::vector<int64_t> bounds_;  // 2S + 1
};

// Expert ownership: rank r owns [FirstExpertOfRank(E, S, r), FirstExpertOfRank(E, S, r + 1)).
int64_t FirstExpertOfRank(int64_t num_experts, int world_size, int rank);
int RankOfExpert(int64_t num_experts, int world_size, int64_t expert);

struct DslpOptions {
  EpMode ep_mode = EpMode::kSmallEp;
  // When set, called for every MoE layer with the router's choice in host memory: ids[i * top_k
  // + j] for the tokens at positions[i] (standard EP: this rank's tokens; SmallEP: the whole
  // prompt, rank-major). On the driving thread. For tests and expert-load statistics.
  std::function<void(int64_t layer, std::span<const int32_t> positions, int64_t top_k,
                     const int32_t* ids)>
      routing_observer;
  // When set, polled before every layer: once true, Prefill stops with Cancelled (the rank leaves
  // the step; its peers' next collective fails, see collective.h). Must outlive the rank.
  const std::atomic<bool>* cancelled = nullptr;
};

// Where one layer's time went on this rank (wall seconds on the driving thread) and what it sent.
struct DslpLayerStats {
  double attention_other_s = 0;    // norms, projections, RoPE, KV write, o_proj (engine code)
  double attention_local_s = 0;    // phase 1: queries against the rank's own chunks
  double ring_s = 0;               // phase 2: pass-KV exchanges (and cache writes of received KV)
  double attention_remote_s = 0;   // phase 2: queries against received chunks
  double attention_project_s = 0;  // W_UV projection of the merged latent
  double gate_sort_s = 0;          // gating and sorting (SmallEP: of the full batch)
  double dispatch_s = 0;           // standard: all-to-all dispatch (+ counts); SmallEP: all-gather
  double experts_s = 0;            // local routed experts
  double shared_s = 0;             // shared experts (local tokens)
  double combine_s = 0;            // standard: all-to-all combine; SmallEP: partial all-to-all
  double reduce_s = 0;             // weighted sum / local reduction
  double ffn_other_s = 0;          // dense MLP (dense layers) and residual add
  // Payload bytes this rank sent (to all peers).
  uint64_t ring_bytes = 0;
  uint64_t dispatch_bytes = 0;  // hidden rows (standard) / all-gather (SmallEP)
  uint64_t combine_bytes = 0;   // expert outputs (standard) / partial sums (SmallEP)
  uint64_t meta_bytes = 0;      // counts and expert ids (standard EP)
  int64_t routed_pairs = 0;     // (token, expert) pairs this rank computed
  int64_t local_pairs = 0;      // of those, pairs of this rank's own tokens
};

struct DslpStats {
  int rank = 0;
  int world_size = 1;
  EpMode ep_mode = EpMode::kSmallEp;
  int64_t prompt_tokens = 0;
  int64_t local_tokens = 0;
  double total_s = 0;
  std::vector<DslpLayerStats> layers;
  // Per peer, over the whole prefill: everything, and by purpose (payload bytes sent to peer p
  // at index p; see DslpLayerStats).
  CommCounters comm;
  std::vector<uint64_t> ring_sent, dispatch_sent, combine_sent, meta_sent;

  DslpLayerStats Sum() const;
};

struct DslpResult {
  // The logits of the prompt's last token on rank 0; empty on the other ranks.
  std::vector<float> logits;
};

class DslpRank {
 public:
  // `engine` and `comm` must outlive the rank. `batch`: a MicroBatch of `engine` the rank drives
  // (e.g. the one a prefill worker already owns, so no second step scratch is allocated); null:
  // the rank allocates its own. It must outlive the rank and be idle between prefills.
  // InvalidArgument when the engine's model has fewer routed experts than ranks.
  static absl::StatusOr<std::unique_ptr<DslpRank>> Create(Engine& engine, Collective& comm,
                                                          const DslpOptions& options = {},
                                                          MicroBatch* batch = nullptr);
  ~DslpRank();
  DslpRank(const DslpRank&) = delete;
  DslpRank& operator=(const DslpRank&) = delete;

  // Prefills `prompt` (the same on every rank) into `sequence` (empty, of a cache on the engine's
  // device): afterwards the sequence holds the whole prompt's KV cache on every rank. Errors: as
  // MicroBatch::BeginDistributedStep, the collective's (Unavailable when a peer died: the group
  // must re-form), InvalidArgument for a prompt shorter than 2S tokens, Cancelled
  // (DslpOptions::cancelled). On error the step is abandoned and the sequence is left empty;
  // work may still be enqueued on the batch's stream (synchronize it before reusing what it
  // reads).
  absl::StatusOr<DslpResult> Prefill(std::span<const int32_t> prompt, KvSequence& sequence);

  const DslpStats& last_stats() const;
  int rank() const;
  int world_size() const;

 private:
  class Impl;
  explicit DslpRank(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hmoe

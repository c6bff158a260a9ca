#pragma once

// The optimized DeepSeek-V3-family forward pass, written once against Device + kernels
// (docs/architecture.md, issue #8). Attention, norms, the dense MLP, the router and lm_head run on
// the attention Device (CpuDevice or CudaDevice); routed and shared experts run on the CPU through
// MoeExecutor (decode) or a grouped expert path (prefill-sized steps), reading host weights in
// place. Weights come from a WeightProvider (resident or streaming), the KV cache is the paged
// latent cache of kv_cache.h, and decode attention is weight-absorbed MLA.
//
// One step processes a batch of sequences, each with its new tokens: a prefill chunk or one
// decode token. Tokens of a sequence are appended at positions sequence->num_tokens() ... . The
// step returns, per sequence that asks for it, the logits of its last new token.
//
// Two ways to run a step:
// - Engine::Forward(inputs): everything, in order; inputs larger than one step's capacity are
//   split into several steps (a long prompt becomes chunked prefill, memory stays bounded).
// - MicroBatch: the per-layer stepping API for dual-batch attention/MoE overlap (paper §3.3.1).
//   Each MicroBatch has its own stream and scratch; the decode worker drives two of them from two
//   threads so one's RunAttention(l) overlaps the other's RunFfn(l').
//
// Numerics: activations are rounded to BF16 at every FP8/BF16 linear layer (the kernels'
// contract), everything else is F32. Logits agree with reference::ReferenceModel to about 1% of
// the logit RMS on the test models (tests/engine states the exact tolerance). Results of a
// sequence do not depend on which other sequences share its step.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "common/device/device.h"
#include "common/engine/kv_cache.h"
#include "common/engine/weights.h"
#include "common/kernels/cpu/fp8_gemv.h"
#include "common/model/model_config.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "common/ops/cpu/moe_executor.h"

namespace hmoe {

// Where routed and shared experts run.
enum class ExpertPlacement {
  kCpu,     // on the CPU pool, weights read in place from WeightProvider::host_moe (default)
  kDevice,  // on the attention device through Acquire(kRoutedExpert/kSharedExperts) (SLP)
};

struct EngineOptions {
  // Tokens (over all sequences) one step processes. Forward splits larger inputs into several
  // steps. Scratch on the attention device grows linearly with it (about
  // max_step_tokens * (nh * (dn + dr + dv) + 2 * hidden + Rq + Rkv + dr + max(inter, vocab)) * 4
  // bytes).
  int64_t max_step_tokens = 256;
  // Sequences one step processes.
  int64_t max_step_sequences = 64;
  ExpertPlacement experts = ExpertPlacement::kCpu;
  // CPU experts: steps with at least this many tokens use the grouped path (tokens gathered per
  // expert, each expert's weights read once per step, GEMM-style); smaller steps use MoeExecutor
  // in chunks of at most 8 tokens (the decode path: two pool barriers per chunk). Non-FP8 experts
  // always take the grouped path.
  int64_t grouped_moe_min_tokens = 16;
  // Executor tuning (max_tokens is set to 8; max_intermediate to the model's).
  MoeExecutorOptions moe;
  // FP8 kernels for CPU experts; null: cpu::DefaultFp8Gemv().
  const cpu::Fp8Gemv* fp8_gemv = nullptr;
  // When set, called for every MoE layer of every step with the router's choice in host memory:
  // ids[t * top_k + j] for the step's rows t < num_tokens (rows in input order, each input's
  // tokens in order). Runs on the thread driving RunFfn; must be cheap and thread-safe if several
  // micro-batches run concurrently. For tests and expert-load statistics.
  std::function<void(int64_t layer, int64_t num_tokens, int64_t top_k, const int32_t* ids)>
      routing_observer;
};

// One sequence's part of a step.
struct SequenceInput {
  // Its KV state (a sequence of a KvCache on the engine's attention device). Not owned; used by
  // this step only.
  KvSequence* sequence = nullptr;
  // The new tokens (>= 1), at positions sequence->num_tokens() ... Valid during the call.
  std::span<const int32_t> tokens;
  // Whether to return the logits of the last new token.
  bool want_logits = true;
};

// Per-step counters (for benchmarks and logs).
struct StepStats {
  int64_t num_tokens = 0;
  int64_t num_sequences = 0;
  // FP8 expert bytes MoeExecutor / the grouped path read (whole experts, scales included).
  int64_t expert_weight_bytes = 0;
  // Wall seconds spent per phase by the thread(s) driving the step.
  double attention_seconds = 0;  // norms, projections, RoPE, cache write, MLA, o_proj, router
  double ffn_seconds = 0;        // dense MLP or experts, residual add
  double head_seconds = 0;       // embedding, final norm, lm_head, logits copy
};

class Engine;

// ---------------------------------------------------------------------------------- distributed
// steps (DSLP, common/dslp)
//
// One rank of a distributed prefill runs a "distributed step": its own tokens of one prompt, at
// explicit (not necessarily contiguous) positions, through the engine's own forward pass, with
// three parts replaced by hooks that talk to the other ranks: the attention core (context
// parallelism), the routing of a MoE layer and the MoE layer itself (expert parallelism).
// Everything else (embedding, norms, projections, RoPE, KV cache writes of the local tokens,
// o_proj, residuals, dense layers, final norm and lm_head) is the engine's code.

// Attention core of `layer` for the step's n local rows: the hook must write out (the heads'
// attention outputs before o_proj, as MLA: [n, nh * dv]) from the queries q and the KV of the
// whole prompt, and leave the cache holding every prompt token's KV of this layer by the end of
// the step (the local tokens' KV is already there).
struct AttentionHookArgs {
  int64_t layer = 0;
  Stream* stream = nullptr;
  const AttentionWeights* weights = nullptr;  // valid during the call (w_uk_t, kv_b)
  MlaDimensions dims;
  // Device pointers, row t = local token t: q [n, nh * (dn + dr)] (q_pe rotated), kv [n, Rkv + dr]
  // (normalized latent, rotated k_pe: what was written to the cache).
  const float* q = nullptr;
  int64_t q_stride = 0;
  const float* kv = nullptr;
  int64_t kv_stride = 0;
  int64_t num_tokens = 0;    // n
  int64_t total_tokens = 0;  // the prompt's length
  KvLayerView cache;         // this layer of the sequence's cache
  // Device pointer: the sequence's block table, covering total_tokens.
  const int32_t* block_table = nullptr;
  float* out = nullptr;
  int64_t out_stride = 0;
};

// Routing of MoE layer `layer`, called while the attention module (router weights) is acquired:
// x [n, hidden] is the post-attention-norm input of the experts. The hook may write the engine's
// routing buffers ids/weights [n, K] (device) for its Moe call, or route elsewhere.
struct RouteHookArgs {
  int64_t layer = 0;
  Stream* stream = nullptr;
  const LinearWeight* router = nullptr;
  const VectorWeight* router_bias = nullptr;
  MoeGateParams params;
  const float* x = nullptr;
  int64_t num_tokens = 0;
  int32_t* ids = nullptr;
  float* weights = nullptr;
};

// MoE layer `layer` (routed and shared experts) for the step's rows: write delta [n, hidden]
// (device), the layer's output before the residual add.
struct MoeHookArgs {
  int64_t layer = 0;
  Stream* stream = nullptr;
  const float* x = nullptr;  // [n, hidden]
  int64_t num_tokens = 0;
  const int32_t* ids = nullptr;  // the routing buffers Route may have written
  const float* weights = nullptr;
  float* delta = nullptr;
};

// Implemented by the distributed prefill (common/dslp). Called on the thread driving the step; an
// error abandons the step.
class DistributedHooks {
 public:
  virtual ~DistributedHooks() = default;
  virtual absl::Status Attention(const AttentionHookArgs& args) = 0;
  virtual absl::Status Route(const RouteHookArgs& args) = 0;
  virtual absl::Status Moe(const MoeHookArgs& args) = 0;
};

struct DistributedStepInput {
  // Empty sequence of a KvCache on the engine's device; reserved for total_tokens at
  // BeginDistributedStep, holding the whole prompt (num_tokens() == total_tokens) after
  // FinishStep.
  KvSequence* sequence = nullptr;
  int64_t total_tokens = 0;
  // This rank's tokens and their positions (strictly increasing, < total_tokens).
  std::span<const int32_t> tokens;
  std::span<const int32_t> positions;
  // Return the logits of the prompt's last token (position total_tokens - 1, which must then be
  // this rank's last token).
  bool want_logits = false;
  // Not owned; used until the step ends.
  DistributedHooks* hooks = nullptr;
};

// A step driver with its own stream and scratch (see the file comment). Call order per step:
// BeginStep, then for l = 0..num_layers-1: RunAttention(l), RunFfn(l); then FinishStep.
// FailedPrecondition on any other order. A failed call abandons the step: the sequences keep
// their previous num_tokens() (blocks reserved for the step stay reserved). Not thread-safe:
// one thread at a time per MicroBatch; different MicroBatches of one Engine may run concurrently
// (their sequences must be disjoint). Must not outlive its Engine.
class MicroBatch {
 public:
  ~MicroBatch();
  MicroBatch(const MicroBatch&) = delete;
  MicroBatch& operator=(const MicroBatch&) = delete;

  // Validates the inputs (InvalidArgument: no inputs, empty token list, a token outside
  // [0, vocab), a sequence given twice or of another cache/device, positions beyond
  // max_position_embeddings, more than max_step_tokens tokens or max_step_sequences sequences),
  // reserves KV blocks for every sequence (ResourceExhausted when the cache is full; nothing is
  // reserved then), and embeds the tokens.
  absl::Status BeginStep(std::span<const SequenceInput> inputs);
  // Begins a distributed step (see DistributedStepInput); then RunAttention / RunFfn per layer
  // and FinishStep as for BeginStep (FinishStep returns one entry: the last token's logits, or
  // empty). InvalidArgument as BeginStep, plus: no hooks, positions not increasing or outside the
  // prompt, logits wanted for a token that is not local; FailedPrecondition when the sequence is
  // not empty; ResourceExhausted when the cache cannot hold the prompt.
  absl::Status BeginDistributedStep(const DistributedStepInput& input);
  // Attention block of `layer`: input norm, q/kv projections, RoPE, KV cache write, MLA, o_proj,
  // residual add, post-attention norm, and the router of a MoE layer.
  absl::Status RunAttention(int64_t layer);
  // Feed-forward of `layer` (dense MLP or experts) and its residual add.
  absl::Status RunFfn(int64_t layer);
  // Final norm and lm_head for the sequences that want logits; commits the new tokens to the
  // sequences (num_tokens advances). Returns one entry per input: vocab_size logits, or empty when
  // !want_logits.
  absl::StatusOr<std::vector<std::vector<float>>> FinishStep();
  // BeginStep + every layer + FinishStep.
  absl::StatusOr<std::vector<std::vector<float>>> RunStep(std::span<const SequenceInput> inputs);
  // Abandons the step in progress (e.g. a prefill cancelled between layers) as a failed call
  // would: the sequences keep their previous num_tokens(). No-op between steps. Work already
  // enqueued on stream() may still run: synchronize it before reusing what it reads.
  void AbandonStep();

  Stream& stream() { return *stream_; }
  bool in_step() const { return phase_ != Phase::kIdle; }
  const StepStats& last_step_stats() const { return stats_; }

 private:
  friend class Engine;
  struct Scratch;
  enum class Phase { kIdle, kAttention, kFfn, kHead };

  explicit MicroBatch(Engine* engine);
  absl::Status Init();
  void Abort();
  // Uploads the laid-out step (positions, slots, block tables, head rows) and embeds its tokens.
  absl::Status UploadStep(absl::Time start_time, int64_t num_sequences);
  absl::Status AttentionImpl(int64_t layer);
  absl::Status FfnImpl(int64_t layer);
  absl::Status DenseMlp(int64_t layer);
  absl::Status ExpertsOnCpu(int64_t layer);
  absl::Status ExpertsOnDevice(int64_t layer);
  absl::StatusOr<std::vector<std::vector<float>>> HeadImpl();

  Engine* engine_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Scratch> scratch_;
  Phase phase_ = Phase::kIdle;
  int64_t next_layer_ = 0;
  StepStats stats_;
  DistributedHooks* hooks_ = nullptr;  // set during a distributed step
};

class Engine {
 public:
  // `weights`, `attention_device` and `pool` must outlive the engine. InvalidArgument for bad
  // options; Unimplemented for models the engine does not run (scoring_func other than sigmoid,
  // topk_method other than noaux_tc, hidden_act other than silu, more than 8 experts per token,
  // moe_layer_freq != 1 layouts are fine). The KV caches used with the engine must live on
  // `attention_device`.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const ModelConfig& config,
                                                        WeightProvider& weights,
                                                        Device& attention_device,
                                                        CpuWorkerPool& pool,
                                                        const EngineOptions& options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Runs `inputs` to completion and returns their logits (one entry per input, empty when
  // !want_logits). Inputs with more tokens than one step holds are split into consecutive steps
  // (an input's logits come from its last chunk). Errors as MicroBatch::BeginStep; if a later
  // step fails, earlier steps stay committed. Not thread-safe with itself (it uses one internal
  // MicroBatch); MicroBatches may run alongside.
  absl::StatusOr<std::vector<std::vector<float>>> Forward(std::span<const SequenceInput> inputs);

  // A new step driver (allocates its scratch from the attention device: ResourceExhausted when
  // the budget is exceeded).
  absl::StatusOr<std::unique_ptr<MicroBatch>> NewMicroBatch();

  const ModelConfig& config() const { return config_; }
  const EngineOptions& options() const { return options_; }
  Device& device() const { return *device_; }
  CpuWorkerPool& pool() const { return *pool_; }
  WeightProvider& weights() const { return *weights_; }
  // Stats of the last Forward's last step.
  const StepStats& last_step_stats() const;

 private:
  friend class MicroBatch;
  struct Constants;

  Engine(const ModelConfig& config, WeightProvider* weights, Device* device, CpuWorkerPool* pool,
         const EngineOptions& options);
  absl::Status Init();

  ModelConfig config_;
  WeightProvider* weights_;
  Device* device_;
  CpuWorkerPool* pool_;
  EngineOptions options_;
  std::unique_ptr<Constants> constants_;
  // The host device for CPU experts' grouped path (shares pool_).
  std::unique_ptr<Device> host_device_;
  std::unique_ptr<MicroBatch> forward_batch_;
};

}  // namespace hmoe

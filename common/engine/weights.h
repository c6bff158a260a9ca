#pragma once

// Weight providers (docs/architecture.md "One forward pass, several weight providers"): the engine
// asks a WeightProvider for each module's weights as device-usable views, in forward order, and
// tells it when it is done with them. ResidentWeights returns views of memory that stays put
// (in place in a WeightSource's host memory on a host-accessible device; resident device copies
// otherwise). A streaming provider (SLP, prefill worker) implements the same interface: Acquire
// waits for the module's ON event tuple (loaded) and orders the stream after it, Release signals
// its OFF event tuple on the stream (the unloader may then free or recycle the memory).
//
// Modules (a module is the unit of loading):
//   kAttention(l)     layer l's attention block: input and post-attention norms, q/kv
//                     projections, the absorbed W_UK^T, o_proj, and the MoE router of a MoE layer
//   kDenseMlp(l)      the dense SwiGLU MLP of a dense layer (l < first_k_dense_replace)
//   kSharedExperts(l) the shared experts of MoE layer l (as one MLP: DeepSeek concatenates them)
//   kRoutedExpert(l, e)
//   kHead             the final norm and lm_head
// The token embedding is always read on the host (host_embedding()); the engine gathers rows and
// copies them to the device.
//
// Order of use by the engine (a streaming loader loads in the same order): per step, for each
// layer l: kAttention(l), then either kDenseMlp(l), or, when experts run on the attention device
// (ExpertPlacement::kDevice), kSharedExperts(l) (if any) and kRoutedExpert(l, e) for EVERY
// e = 0..E-1 in increasing order (experts no token chose are acquired and released at once, so a
// ring buffer advances in a fixed order); finally kHead (every step, even when no sequence wants
// logits). With experts on the CPU (the default),
// routed and shared experts are read from host_moe(l) and never acquired. A rank of a distributed
// prefill (DSLP, common/dslp) acquires kAttention(l), then, for a MoE layer, kSharedExperts(l)
// (if any) and only ITS OWN routed experts (a contiguous id range) in increasing order; finally
// kHead.
// kAttention(l) of a MoE layer is held while the router runs, which under SmallEP includes an
// all-gather of the tokens.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/device/device.h"
#include "common/model/model_config.h"
#include "common/model/tensor.h"
#include "common/ops/cpu/moe_executor.h"

namespace hmoe {

enum class ModuleKind : uint8_t {
  kAttention,
  kDenseMlp,
  kSharedExperts,
  kRoutedExpert,
  kHead,
};

struct ModuleId {
  ModuleKind kind = ModuleKind::kAttention;
  int32_t layer = -1;   // -1 for kHead
  int32_t expert = -1;  // kRoutedExpert only

  bool operator==(const ModuleId&) const = default;
};

// "attention(3)", "expert(3,17)", "head", ...
std::string ModuleName(const ModuleId& id);

// Device views of one layer's attention module. Every LinearWeight is FP8 (block scales), BF16
// or F32; norms are VectorWeights.
struct AttentionWeights {
  VectorWeight input_norm;  // [hidden]
  VectorWeight post_norm;   // [hidden] post_attention_layernorm
  // With q_lora_rank: q_a [Rq, hidden], q_a_norm [Rq], q_b [nh * (dn + dr), Rq]. Without: q.
  LinearWeight q_a;
  VectorWeight q_a_norm;
  LinearWeight q_b;
  LinearWeight q;
  LinearWeight kv_a;  // [Rkv + dr, hidden] kv_a_proj_with_mqa
  VectorWeight kv_a_norm;
  LinearWeight kv_b;                 // [nh * (dn + dv), Rkv]
  std::vector<LinearWeight> w_uk_t;  // per head: W_UK_h^T [Rkv, dn] (see PrepareAbsorbedUk)
  LinearWeight o;                    // [hidden, nh * dv]
  // MoE layers only: router [E, hidden] (BF16/F32) and e_score_correction_bias [E] (or empty).
  LinearWeight router;
  VectorWeight router_bias;
};

// A SwiGLU MLP: down(SiLU(gate x) * up x). gate/up [inter, hidden], down [hidden, inter].
struct MlpWeights {
  LinearWeight gate;
  LinearWeight up;
  LinearWeight down;
};

struct HeadWeights {
  VectorWeight final_norm;  // [hidden]
  LinearWeight lm_head;     // [vocab, hidden], BF16/F32 (the embedding when tied)
};

// What Acquire returns; only the member matching the module's kind is meaningful.
struct ModuleWeights {
  AttentionWeights attention;  // kAttention
  MlpWeights mlp;              // kDenseMlp, kSharedExperts, kRoutedExpert
  HeadWeights head;            // kHead
};

// The experts of one MoE layer in HOST memory, for the CPU expert paths.
struct HostMoeWeights {
  // FP8 experts split into the pool's NUMA parts, for MoeExecutor (decode). Empty `routed` when
  // the experts are not FP8 (then only the grouped path below is used).
  MoeLayerWeights parts;
  // Whole experts as host LinearWeights (grouped prefill path, any dtype), indexed by expert id;
  // `shared` holds the shared-experts MLP (empty when the model has none).
  std::vector<MlpWeights> routed;
  std::vector<MlpWeights> shared;
};

class WeightProvider {
 public:
  virtual ~WeightProvider() = default;

  // The token embedding [vocab, hidden] in host memory (BF16/F16/F32). Valid while the provider
  // lives.
  virtual const TensorView& host_embedding() const = 0;
  // Host experts of MoE layer `layer`; null for a dense layer or a provider without host experts.
  virtual const HostMoeWeights* host_moe(int64_t layer) const = 0;

  // Makes `module`'s weights usable by work enqueued on `stream` from now on and returns their
  // views, valid until the matching Release. A streaming provider host-waits for the module's ON
  // event tuple (DeadlineExceeded / its own errors) and makes `stream` wait on its device event.
  // NotFound for a module the model does not have. Thread-safety: ResidentWeights is thread-safe;
  // streaming providers may require a single driving thread.
  virtual absl::StatusOr<const ModuleWeights*> Acquire(const ModuleId& module, Stream& stream) = 0;
  // The engine has enqueued its last use of `module` on `stream`. A streaming provider signals the
  // module's OFF event tuple on `stream`.
  virtual absl::Status Release(const ModuleId& module, Stream& stream) = 0;
};

// ---------------------------------------------------------------------------------- helpers

// A device view of a host weight (`w` must stay alive and unmoved): FP8 with its scale tensor,
// BF16 or F32, 1-D weights as one row. InvalidArgument for other dtypes, missing scales or a
// scale tensor that is not 4-byte aligned.
absl::StatusOr<LinearWeight> LinearWeightOf(const Weight& w);
// A VectorWeight of a 1-D BF16/F16/F32 tensor; InvalidArgument otherwise.
absl::StatusOr<VectorWeight> VectorWeightOf(const TensorView& t);

// Host storage of the absorbed W_UK_h^T of one layer, built from kv_b_proj:
// - FP8 kv_b whose heads are aligned to the 128x128 scale blocks (nope_dim and nope_dim + v_dim
//   multiples of 128, as in DeepSeek-V3): a transposed FP8 copy per head, with each head's scale
//   blocks transposed (exact: transposing a block keeps its elements and its scale);
// - BF16 or F32 kv_b: a transposed copy in the same dtype (exact);
// - FP8 kv_b with unaligned heads (small test models): a transposed F32 copy of the dequantized
//   values (exact up to one F32 rounding of code * scale).
// Owns its bytes; `heads` views them. Move-only (views stay valid across moves).
struct AbsorbedUk {
  std::vector<LinearWeight> heads;  // [num_heads], each [kv_lora_rank, nope_dim]
  std::unique_ptr<std::byte[]> data;
  size_t data_bytes = 0;
  std::unique_ptr<float[]> scales;
  size_t num_scales = 0;
};
absl::StatusOr<AbsorbedUk> PrepareAbsorbedUk(const ModelConfig& config, const Weight& kv_b);

// ---------------------------------------------------------------------------------- resident

struct ResidentWeightsOptions {
  // false (default): on a host-accessible device, views point into the WeightSource's memory
  // (zero copy) and only W_UK^T is a new host copy. true, or a device that is not host
  // accessible: every module's tensors are copied once into DeviceBuffers of the device (budget
  // permitting: ResourceExhausted otherwise). Host experts always stay in place.
  bool copy_to_device = false;
  // Parts per expert for MoeExecutor (= the CpuWorkerPool's num_nodes()).
  int moe_parts = 1;
  // Whether expert modules (kRoutedExpert, kSharedExperts) are available through Acquire when
  // copying to the device (they are copied too: only for models whose experts fit). Without
  // copying they are always available (host views). Acquiring an unavailable expert module is
  // FailedPrecondition.
  bool experts_on_device = false;
};

// Every module resident for the provider's lifetime. Acquire/Release never block. Thread-safe.
class ResidentWeights final : public WeightProvider {
 public:
  // Looks up and validates every tensor the forward needs (ExpectedTensors names and shapes;
  // errors name the tensor). `source` must outlive the provider (views point into it); `device`
  // too. Unimplemented for configs the engine does not support (see Engine::Create).
  static absl::StatusOr<std::unique_ptr<ResidentWeights>> Create(
      const ModelConfig& config, const WeightSource& source, Device& device,
      const ResidentWeightsOptions& options = {});
  ~ResidentWeights() override;

  const TensorView& host_embedding() const override { return embedding_; }
  const HostMoeWeights* host_moe(int64_t layer) const override;
  absl::StatusOr<const ModuleWeights*> Acquire(const ModuleId& module, Stream& stream) override;
  absl::Status Release(const ModuleId& module, Stream& stream) override;

  // Bytes copied to the device (0 when reading in place).
  size_t device_bytes() const { return device_bytes_; }

 private:
  ResidentWeights() = default;
  struct Layer;

  absl::Status Load(const ModelConfig& config, const WeightSource& source, Device& device,
                    const ResidentWeightsOptions& options);
  // Copies a view into a new DeviceBuffer when copying; returns the device view.
  absl::StatusOr<LinearWeight> Place(Device& device, Stream& stream, const LinearWeight& w);
  absl::StatusOr<VectorWeight> Place(Device& device, Stream& stream, const VectorWeight& w);

  bool copy_ = false;
  TensorView embedding_;
  std::vector<std::unique_ptr<Layer>> layers_;
  ModuleWeights head_;
  std::vector<DeviceBuffer> device_buffers_;
  size_t device_bytes_ = 0;
};

}  // namespace hmoe

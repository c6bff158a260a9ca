#include "common/engine/weights.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/model/tensor_map.h"

namespace hmoe {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) absl::StrAppend(&s, i == 0 ? "" : ", ", shape[i]);
  return s + "]";
}

size_t LinearBytes(const LinearWeight& w) {
  return DTypeBytes(w.dtype, (w.rows - 1) * w.row_stride + w.cols);
}

size_t ScaleFloats(const LinearWeight& w) {
  if (w.dtype != DType::kF8E4M3) return 0;
  return static_cast<size_t>((CeilDiv(w.rows, kFp8BlockSize) - 1) * w.scale_stride +
                             CeilDiv(w.cols, kFp8BlockSize));
}

absl::Status ExpertsNotOnDevice(const ModuleId& id);

}  // namespace

std::string ModuleName(const ModuleId& id) {
  switch (id.kind) {
    case ModuleKind::kAttention:
      return absl::StrCat("attention(", id.layer, ")");
    case ModuleKind::kDenseMlp:
      return absl::StrCat("dense_mlp(", id.layer, ")");
    case ModuleKind::kSharedExperts:
      return absl::StrCat("shared_experts(", id.layer, ")");
    case ModuleKind::kRoutedExpert:
      return absl::StrCat("expert(", id.layer, ",", id.expert, ")");
    case ModuleKind::kHead:
      return "head";
  }
  return "?";
}

absl::StatusOr<LinearWeight> LinearWeightOf(const Weight& w) {
  const TensorView& t = w.tensor;
  if (t.shape.empty() || t.shape.size() > 2 || t.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight ", t.name, ": expected a 1-D or 2-D tensor, got ", ShapeString(t.shape)));
  }
  LinearWeight lw;
  lw.dtype = t.dtype;
  lw.data = t.data;
  lw.rows = t.shape.size() == 2 ? t.shape[0] : 1;
  lw.cols = t.shape.size() == 2 ? t.shape[1] : t.shape[0];
  lw.row_stride = lw.cols;
  if (IsBlockDType(t.dtype) && lw.cols % DTypeBlockElements(t.dtype) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("weight ", t.name, ": rows of ", lw.cols,
                                                   " are not whole ",
                                                   std::string(DTypeName(t.dtype)), " blocks"));
  }
  if (t.size_bytes < DTypeBytes(t.dtype, lw.rows * lw.cols)) {
    return absl::InvalidArgumentError(absl::StrCat("weight ", t.name, ": too few bytes"));
  }
  switch (t.dtype) {
    case DType::kF8E4M3: {
      const TensorView& s = w.scale_inv;
      const std::vector<int64_t> want = ScaleInvShape(t.shape);
      if (!w.has_scale || s.dtype != DType::kF32 || s.shape != want || s.data == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "weight ", t.name, ": FP8 without an F32 scale tensor of ", ShapeString(want)));
      }
      if (reinterpret_cast<uintptr_t>(s.data) % alignof(float) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("weight ", t.name, ": scale tensor is not 4-byte aligned"));
      }
      lw.scale_inv = reinterpret_cast<const float*>(s.data);
      lw.scale_stride = want[1];
      return lw;
    }
    case DType::kBF16:
    case DType::kF16:
    case DType::kQ8_0:
    case DType::kQ5_0:
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K:
      return lw;
    case DType::kF32:
      if (reinterpret_cast<uintptr_t>(t.data) % alignof(float) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("weight ", t.name, ": F32 tensor is not 4-byte aligned"));
      }
      return lw;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "weight ", t.name, ": dtype ", std::string(DTypeName(t.dtype)),
          " is not supported (FP8 E4M3, BF16, F16, F32, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K)"));
  }
}

absl::StatusOr<VectorWeight> VectorWeightOf(const TensorView& t) {
  if (t.shape.size() != 1 || t.data == nullptr ||
      (t.dtype != DType::kBF16 && t.dtype != DType::kF16 && t.dtype != DType::kF32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", t.name, ": expected a 1-D BF16/F16/F32 vector"));
  }
  return VectorWeight{t.dtype, t.data, t.shape[0]};
}

absl::StatusOr<AbsorbedUk> PrepareAbsorbedUk(const ModelConfig& config, const Weight& kv_b) {
  const int64_t nh = config.num_attention_heads;
  const int64_t dn = config.qk_nope_head_dim;
  const int64_t dv = config.v_head_dim;
  const int64_t rkv = config.kv_lora_rank;
  const int64_t head_rows = dn + dv;
  HMOE_ASSIGN_OR_RETURN(const LinearWeight w, LinearWeightOf(kv_b));
  if (IsBlockDType(w.dtype) || w.dtype == DType::kF16) {
    // GGUF sources hand kv_b_proj over dequantized to F32 (GgufCheckpoint).
    return absl::InvalidArgumentError(absl::StrCat("kv_b_proj ", kv_b.tensor.name, ": dtype ",
                                                   std::string(DTypeName(w.dtype)),
                                                   " is not supported (FP8, BF16 or F32)"));
  }
  if (w.rows != nh * head_rows || w.cols != rkv) {
    return absl::InvalidArgumentError(absl::StrCat("kv_b_proj ", kv_b.tensor.name, ": shape [",
                                                   w.rows, ", ", w.cols, "], expected [",
                                                   nh * head_rows, ", ", rkv, "]"));
  }
  AbsorbedUk out;
  out.heads.resize(nh);
  const bool fp8 = w.dtype == DType::kF8E4M3;
  const bool aligned = dn % kFp8BlockSize == 0 && head_rows % kFp8BlockSize == 0;
  // Per head: [rkv, dn] of the output dtype.
  const DType dtype = fp8 ? (aligned ? DType::kF8E4M3 : DType::kF32) : w.dtype;
  const size_t elem = DTypeSize(dtype);
  const size_t head_bytes = static_cast<size_t>(rkv * dn) * elem;
  out.data_bytes = head_bytes * nh;
  out.data.reset(new std::byte[out.data_bytes]);
  const int64_t scale_rows = CeilDiv(rkv, kFp8BlockSize);
  const int64_t scale_cols = CeilDiv(dn, kFp8BlockSize);
  if (dtype == DType::kF8E4M3) {
    out.num_scales = static_cast<size_t>(nh * scale_rows * scale_cols);
    out.scales.reset(new float[out.num_scales]);
  }
  const std::byte* src = static_cast<const std::byte*>(w.data);
  const size_t src_elem = DTypeSize(w.dtype);
  for (int64_t h = 0; h < nh; ++h) {
    std::byte* dst = out.data.get() + h * head_bytes;
    const int64_t row0 = h * head_rows;  // W_UK_h is rows row0 .. row0 + dn of kv_b
    for (int64_t r = 0; r < rkv; ++r) {
      for (int64_t i = 0; i < dn; ++i) {
        const std::byte* s = src + static_cast<size_t>((row0 + i) * w.row_stride + r) * src_elem;
        std::byte* d = dst + static_cast<size_t>(r * dn + i) * elem;
        if (dtype == w.dtype) {
          std::memcpy(d, s, elem);  // exact transpose (FP8 codes, BF16 or F32 values)
        } else {
          // FP8 with unaligned heads: dequantize to F32.
          const float value =
              Fp8E4M3ToFloat(static_cast<uint8_t>(*s)) *
              w.scale_inv[((row0 + i) / kFp8BlockSize) * w.scale_stride + r / kFp8BlockSize];
          std::memcpy(d, &value, sizeof(value));
        }
      }
    }
    LinearWeight& t = out.heads[h];
    t.dtype = dtype;
    t.data = dst;
    t.rows = rkv;
    t.cols = dn;
    t.row_stride = dn;
    if (dtype == DType::kF8E4M3) {
      // Block (rb, cb) of W_UK_h^T is the transpose of block (row0 / 128 + cb, rb) of kv_b.
      float* scales = out.scales.get() + h * scale_rows * scale_cols;
      for (int64_t rb = 0; rb < scale_rows; ++rb) {
        for (int64_t cb = 0; cb < scale_cols; ++cb) {
          scales[rb * scale_cols + cb] =
              w.scale_inv[(row0 / kFp8BlockSize + cb) * w.scale_stride + rb];
        }
      }
      t.scale_inv = scales;
      t.scale_stride = scale_cols;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------- resident

struct ResidentWeights::Layer {
  bool is_moe = false;
  ModuleWeights attention;
  ModuleWeights dense;   // !is_moe
  ModuleWeights shared;  // is_moe && has_shared
  bool has_shared = false;
  std::vector<ModuleWeights> experts;  // is_moe (device views)
  HostMoeWeights host;                 // is_moe
  AbsorbedUk uk;
};

ResidentWeights::~ResidentWeights() = default;

absl::StatusOr<std::unique_ptr<ResidentWeights>> ResidentWeights::Create(
    const ModelConfig& config, const WeightSource& source, Device& device,
    const ResidentWeightsOptions& options) {
  if (options.moe_parts < 1) {
    return absl::InvalidArgumentError("resident weights: moe_parts must be >= 1");
  }
  HMOE_RETURN_IF_ERROR(ValidateTensors(config, source));
  std::unique_ptr<ResidentWeights> w(new ResidentWeights());
  HMOE_RETURN_IF_ERROR(w->Load(config, source, device, options));
  return w;
}

absl::StatusOr<LinearWeight> ResidentWeights::Place(Device& device, Stream& stream,
                                                    const LinearWeight& w) {
  if (!copy_ || w.empty()) return w;
  LinearWeight out = w;
  const size_t bytes = LinearBytes(w);
  HMOE_ASSIGN_OR_RETURN(DeviceBuffer data, device.Allocate(bytes));
  HMOE_RETURN_IF_ERROR(device.CopyToDevice(stream, data.data(), w.data, bytes));
  out.data = data.data();
  device_bytes_ += bytes;
  device_buffers_.push_back(std::move(data));
  if (w.dtype == DType::kF8E4M3) {
    const size_t scale_bytes = ScaleFloats(w) * sizeof(float);
    HMOE_ASSIGN_OR_RETURN(DeviceBuffer scales, device.Allocate(scale_bytes));
    HMOE_RETURN_IF_ERROR(device.CopyToDevice(stream, scales.data(), w.scale_inv, scale_bytes));
    out.scale_inv = scales.as<float>();
    device_bytes_ += scale_bytes;
    device_buffers_.push_back(std::move(scales));
  }
  return out;
}

absl::StatusOr<VectorWeight> ResidentWeights::Place(Device& device, Stream& stream,
                                                    const VectorWeight& w) {
  if (!copy_ || w.empty()) return w;
  const size_t bytes = static_cast<size_t>(w.size) * DTypeSize(w.dtype);
  HMOE_ASSIGN_OR_RETURN(DeviceBuffer data, device.Allocate(bytes));
  HMOE_RETURN_IF_ERROR(device.CopyToDevice(stream, data.data(), w.data, bytes));
  VectorWeight out = w;
  out.data = data.data();
  device_bytes_ += bytes;
  device_buffers_.push_back(std::move(data));
  return out;
}

absl::Status ResidentWeights::Load(const ModelConfig& c, const WeightSource& source, Device& device,
                                   const ResidentWeightsOptions& options) {
  copy_ = options.copy_to_device || !device.host_accessible();
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.CreateStream());
  Stream& s = *stream;
  auto linear = [&](const std::string& name) -> absl::StatusOr<LinearWeight> {
    HMOE_ASSIGN_OR_RETURN(Weight w, source.GetWeight(name));
    HMOE_ASSIGN_OR_RETURN(LinearWeight lw, LinearWeightOf(w));
    return Place(device, s, lw);
  };
  auto host_linear = [&](const std::string& name) -> absl::StatusOr<LinearWeight> {
    HMOE_ASSIGN_OR_RETURN(Weight w, source.GetWeight(name));
    return LinearWeightOf(w);
  };
  auto vector = [&](const std::string& name) -> absl::StatusOr<VectorWeight> {
    HMOE_ASSIGN_OR_RETURN(TensorView t, source.GetTensor(name));
    HMOE_ASSIGN_OR_RETURN(VectorWeight v, VectorWeightOf(t));
    return Place(device, s, v);
  };

  HMOE_ASSIGN_OR_RETURN(embedding_, source.GetTensor(std::string(kEmbedTokensName)));
  if (embedding_.dtype != DType::kBF16 && embedding_.dtype != DType::kF16 &&
      embedding_.dtype != DType::kF32 && !IsBlockDType(embedding_.dtype)) {
    return absl::InvalidArgumentError(
        "embed_tokens: expected BF16/F16/F32 or a GGML block type (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K)");
  }
  HMOE_ASSIGN_OR_RETURN(head_.head.final_norm, vector(std::string(kFinalNormName)));
  HMOE_ASSIGN_OR_RETURN(
      head_.head.lm_head,
      linear(std::string(c.tie_word_embeddings ? kEmbedTokensName : kLmHeadName)));

  namespace lt = layer_tensor;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    auto layer = std::make_unique<Layer>();
    auto name = [l](std::string_view suffix) { return LayerTensorName(l, suffix); };
    AttentionWeights& a = layer->attention.attention;
    HMOE_ASSIGN_OR_RETURN(a.input_norm, vector(name(lt::kInputLayernorm)));
    HMOE_ASSIGN_OR_RETURN(a.post_norm, vector(name(lt::kPostAttentionLayernorm)));
    if (c.q_lora_rank.has_value()) {
      HMOE_ASSIGN_OR_RETURN(a.q_a, linear(name(lt::kQAProj)));
      HMOE_ASSIGN_OR_RETURN(a.q_a_norm, vector(name(lt::kQALayernorm)));
      HMOE_ASSIGN_OR_RETURN(a.q_b, linear(name(lt::kQBProj)));
    } else {
      HMOE_ASSIGN_OR_RETURN(a.q, linear(name(lt::kQProj)));
    }
    HMOE_ASSIGN_OR_RETURN(a.kv_a, linear(name(lt::kKvAProjWithMqa)));
    HMOE_ASSIGN_OR_RETURN(a.kv_a_norm, vector(name(lt::kKvALayernorm)));
    HMOE_ASSIGN_OR_RETURN(Weight kv_b, source.GetWeight(name(lt::kKvBProj)));
    HMOE_ASSIGN_OR_RETURN(layer->uk, PrepareAbsorbedUk(c, kv_b));
    HMOE_ASSIGN_OR_RETURN(LinearWeight kv_b_view, LinearWeightOf(kv_b));
    HMOE_ASSIGN_OR_RETURN(a.kv_b, Place(device, s, kv_b_view));
    for (const LinearWeight& head : layer->uk.heads) {
      HMOE_ASSIGN_OR_RETURN(LinearWeight placed, Place(device, s, head));
      a.w_uk_t.push_back(placed);
    }
    HMOE_ASSIGN_OR_RETURN(a.o, linear(name(lt::kOProj)));

    layer->is_moe = c.is_moe_layer(l);
    if (!layer->is_moe) {
      MlpWeights& m = layer->dense.mlp;
      HMOE_ASSIGN_OR_RETURN(m.gate, linear(name(lt::kMlpGateProj)));
      HMOE_ASSIGN_OR_RETURN(m.up, linear(name(lt::kMlpUpProj)));
      HMOE_ASSIGN_OR_RETURN(m.down, linear(name(lt::kMlpDownProj)));
      layers_.push_back(std::move(layer));
      continue;
    }
    HMOE_ASSIGN_OR_RETURN(a.router, linear(name(lt::kRouterWeight)));
    if (a.router.dtype != DType::kBF16 && a.router.dtype != DType::kF32 &&
        !IsBlockDType(a.router.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          name(lt::kRouterWeight), ": the router must be BF16, F32 or a GGML block type"));
    }
    if (c.topk_method == "noaux_tc") {
      HMOE_ASSIGN_OR_RETURN(a.router_bias, vector(name(lt::kRouterBias)));
    }

    // Experts: host views in place (CPU paths), device views (device placement).
    HostMoeWeights& host = layer->host;
    host.parts.hidden = c.hidden_size;
    bool all_fp8 = true;
    auto load_mlp = [&](const std::string& gate, const std::string& up, const std::string& down,
                        MlpWeights* host_mlp, MlpWeights* device_mlp,
                        MoeExpertWeights* parts) -> absl::Status {
      HMOE_ASSIGN_OR_RETURN(host_mlp->gate, host_linear(gate));
      HMOE_ASSIGN_OR_RETURN(host_mlp->up, host_linear(up));
      HMOE_ASSIGN_OR_RETURN(host_mlp->down, host_linear(down));
      if (!copy_ || options.experts_on_device) {
        HMOE_ASSIGN_OR_RETURN(device_mlp->gate, Place(device, s, host_mlp->gate));
        HMOE_ASSIGN_OR_RETURN(device_mlp->up, Place(device, s, host_mlp->up));
        HMOE_ASSIGN_OR_RETURN(device_mlp->down, Place(device, s, host_mlp->down));
      }
      const bool fp8 = host_mlp->gate.dtype == DType::kF8E4M3 &&
                       host_mlp->up.dtype == DType::kF8E4M3 &&
                       host_mlp->down.dtype == DType::kF8E4M3;
      all_fp8 = all_fp8 && fp8;
      if (fp8) {
        HMOE_ASSIGN_OR_RETURN(Weight g, source.GetWeight(gate));
        HMOE_ASSIGN_OR_RETURN(Weight u, source.GetWeight(up));
        HMOE_ASSIGN_OR_RETURN(Weight d, source.GetWeight(down));
        HMOE_ASSIGN_OR_RETURN(cpu::Fp8MatrixView gv, Fp8ViewOfWeight(g));
        HMOE_ASSIGN_OR_RETURN(cpu::Fp8MatrixView uv, Fp8ViewOfWeight(u));
        HMOE_ASSIGN_OR_RETURN(cpu::Fp8MatrixView dv, Fp8ViewOfWeight(d));
        HMOE_ASSIGN_OR_RETURN(*parts, SplitExpert(gv, uv, dv, options.moe_parts));
      }
      return absl::OkStatus();
    };
    const int64_t num_experts = c.n_routed_experts;
    host.routed.resize(num_experts);
    host.parts.routed.resize(num_experts);
    layer->experts.resize(num_experts);
    for (int64_t e = 0; e < num_experts; ++e) {
      HMOE_RETURN_IF_ERROR(load_mlp(ExpertTensorName(l, e, kGateProj),
                                    ExpertTensorName(l, e, kUpProj),
                                    ExpertTensorName(l, e, kDownProj), &host.routed[e],
                                    &layer->experts[e].mlp, &host.parts.routed[e]));
    }
    layer->has_shared = c.n_shared_experts > 0;
    if (layer->has_shared) {
      host.shared.resize(1);
      host.parts.shared.resize(1);
      HMOE_RETURN_IF_ERROR(load_mlp(SharedExpertTensorName(l, kGateProj),
                                    SharedExpertTensorName(l, kUpProj),
                                    SharedExpertTensorName(l, kDownProj), &host.shared[0],
                                    &layer->shared.mlp, &host.parts.shared[0]));
    }
    if (!all_fp8) {
      host.parts.routed.clear();
      host.parts.shared.clear();
    }
    layers_.push_back(std::move(layer));
  }
  return s.Synchronize();
}

const HostMoeWeights* ResidentWeights::host_moe(int64_t layer) const {
  if (layer < 0 || layer >= static_cast<int64_t>(layers_.size()) || !layers_[layer]->is_moe) {
    return nullptr;
  }
  return &layers_[layer]->host;
}

absl::StatusOr<const ModuleWeights*> ResidentWeights::Acquire(const ModuleId& id, Stream&) {
  if (id.kind == ModuleKind::kHead) return &head_;
  if (id.layer < 0 || id.layer >= static_cast<int32_t>(layers_.size())) {
    return absl::NotFoundError(absl::StrCat("weights: no module ", ModuleName(id)));
  }
  const Layer& layer = *layers_[id.layer];
  switch (id.kind) {
    case ModuleKind::kAttention:
      return &layer.attention;
    case ModuleKind::kDenseMlp:
      if (!layer.is_moe) return &layer.dense;
      break;
    case ModuleKind::kSharedExperts:
      if (layer.is_moe && layer.has_shared) {
        if (layer.shared.mlp.gate.empty()) return ExpertsNotOnDevice(id);
        return &layer.shared;
      }
      break;
    case ModuleKind::kRoutedExpert:
      if (layer.is_moe && id.expert >= 0 &&
          id.expert < static_cast<int32_t>(layer.experts.size())) {
        if (layer.experts[id.expert].mlp.gate.empty()) return ExpertsNotOnDevice(id);
        return &layer.experts[id.expert];
      }
      break;
    case ModuleKind::kHead:
      break;
  }
  return absl::NotFoundError(absl::StrCat("weights: no module ", ModuleName(id)));
}

namespace {
absl::Status ExpertsNotOnDevice(const ModuleId& id) {
  return absl::FailedPreconditionError(
      absl::StrCat("weights: ", ModuleName(id),
                   " is not on the device (ResidentWeightsOptions::experts_on_device is off)"));
}
}  // namespace

absl::Status ResidentWeights::Release(const ModuleId&, Stream&) { return absl::OkStatus(); }

}  // namespace hmoe

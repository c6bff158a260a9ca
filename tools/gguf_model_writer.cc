#include "tools/gguf_model_writer.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/model/gguf.h"
#include "common/model/gguf_model.h"
#include "common/model/gguf_quants.h"
#include "common/model/tensor_map.h"
#include "tools/tokenizer_builder.h"

namespace hmoe {
namespace {

namespace fs = std::filesystem;

absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr uint32_t T(GgmlType t) { return static_cast<uint32_t>(t); }

// One GGUF tensor to write: where its values come from.
struct GgufPlan {
  std::string name;
  std::vector<int64_t> ne;
  uint32_t type = 0;
  size_t bytes = 0;
  std::vector<const ExpectedTensor*> sources;  // one, or one per expert (stacked)
  int kv_part = 0;                             // 1: attn_k_b, 2: attn_v_b (from kv_b_proj)
};

// Runs fn(i) for i in [0, n) on up to `threads` threads.
void ParallelRows(int threads, int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t parts = std::clamp<int64_t>(threads, 1, std::max<int64_t>(n, 1));
  std::vector<std::jthread> pool;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t b = n * p / parts, e = n * (p + 1) / parts;
    try {
      pool.emplace_back([&fn, b, e] { fn(b, e); });
    } catch (const std::system_error&) {
      fn(b, e);
    }
  }
  fn(0, n / parts);
}

// Quantizes `rows` rows of `cols` values from `values` into `out` (rows of whole blocks).
absl::Status QuantizeRows(uint32_t type, const float* values, int64_t rows, int64_t cols,
                          std::byte* out, int threads) {
  size_t row_bytes = 0;
  HMOE_RETURN_IF_ERROR(GgmlBytes(type, cols, &row_bytes));
  ParallelRows(threads, rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      absl::Status s = QuantizeGgml(type, values + r * cols, cols, out + r * row_bytes);
      if (!s.ok()) HMOE_CHECK(false) << s;
    }
  });
  return absl::OkStatus();
}

absl::Status WriteTensorValues(const GgufPlan& p, const ModelConfig& config,
                               const GgufWriteOptions& options, GgufWriter* writer) {
  const int64_t cols = p.ne[0];
  size_t row_bytes = 0;
  HMOE_RETURN_IF_ERROR(GgmlBytes(p.type, cols, &row_bytes));
  std::vector<float> values;
  std::vector<std::byte> bytes;
  if (p.kv_part != 0) {
    // kv_b_proj [nh*(dn+dv), Rkv] -> k_b [nh][Rkv][dn] or v_b [nh][dv][Rkv].
    const ExpectedTensor& t = *p.sources.front();
    const std::vector<float> kv = GenerateTensor(t, config, options.seed);
    const int64_t nh = config.num_attention_heads, rkv = config.kv_lora_rank;
    const int64_t dn = config.qk_nope_head_dim, dv = config.v_head_dim;
    values.resize(static_cast<size_t>(p.ne[0] * p.ne[1] * p.ne[2]));
    for (int64_t h = 0; h < nh; ++h) {
      if (p.kv_part == 1) {
        for (int64_t j = 0; j < rkv; ++j) {
          for (int64_t i = 0; i < dn; ++i) {
            values[static_cast<size_t>((h * rkv + j) * dn + i)] =
                kv[static_cast<size_t>((h * (dn + dv) + i) * rkv + j)];
          }
        }
      } else {
        for (int64_t i = 0; i < dv; ++i) {
          for (int64_t j = 0; j < rkv; ++j) {
            values[static_cast<size_t>((h * dv + i) * rkv + j)] =
                kv[static_cast<size_t>((h * (dn + dv) + dn + i) * rkv + j)];
          }
        }
      }
    }
    const int64_t rows = static_cast<int64_t>(values.size()) / cols;
    bytes.resize(static_cast<size_t>(rows) * row_bytes);
    HMOE_RETURN_IF_ERROR(
        QuantizeRows(p.type, values.data(), rows, cols, bytes.data(), options.num_threads));
    return writer->WriteTensorData(p.name, bytes);
  }
  for (const ExpectedTensor* t : p.sources) {  // one slab per source (expert)
    const int64_t rows = t->shape.size() > 1 ? t->shape[0] : 1;
    values.resize(static_cast<size_t>(rows * cols));
    ParallelRows(options.num_threads, rows, [&](int64_t r0, int64_t r1) {
      GenerateRows(*t, config, options.seed, r0, r1, values.data() + r0 * cols);
    });
    bytes.resize(static_cast<size_t>(rows) * row_bytes);
    HMOE_RETURN_IF_ERROR(
        QuantizeRows(p.type, values.data(), rows, cols, bytes.data(), options.num_threads));
    HMOE_RETURN_IF_ERROR(writer->WriteTensorData(p.name, bytes));
  }
  return absl::OkStatus();
}

bool IsGgufModelFile(const std::string& name) {
  return name == "model.gguf" || (name.starts_with("model-") && name.ends_with(".gguf"));
}

absl::Status PrepareGgufDirectory(const std::string& dir, bool force) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    fs::create_directories(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("create ", dir, ": ", ec.message()));
    return absl::OkStatus();
  }
  if (!fs::is_directory(dir, ec)) {
    return absl::AlreadyExistsError(absl::StrCat(dir, " exists and is not a directory"));
  }
  std::vector<fs::path> existing;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    existing.push_back(it->path());
  }
  if (!existing.empty() && !force) {
    return absl::AlreadyExistsError(
        absl::StrCat(dir, " is not empty (", existing.size(), " entries); use --force"));
  }
  for (const fs::path& path : existing) {
    if (IsGgufModelFile(path.filename().string())) fs::remove(path, ec);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GgufQuantMix> ParseGgufQuantMix(std::string_view name) {
  if (name == "q4_k_m") return GgufQuantMix::kQ4_K_M;
  if (name == "q5_k_m") return GgufQuantMix::kQ5_K_M;
  if (name == "q8_0") return GgufQuantMix::kQ8_0;
  if (name == "bf16") return GgufQuantMix::kBF16;
  if (name == "f16") return GgufQuantMix::kF16;
  if (name == "f32") return GgufQuantMix::kF32;
  return absl::InvalidArgumentError(absl::StrCat("unknown GGUF quantization \"", Av(name),
                                                 "\" (q4_k_m, q5_k_m, q8_0, bf16, f16, f32)"));
}

uint32_t GgufFileType(GgufQuantMix mix) {
  switch (mix) {
    case GgufQuantMix::kQ4_K_M:
      return 15;
    case GgufQuantMix::kQ5_K_M:
      return 17;
    case GgufQuantMix::kQ8_0:
      return 7;
    case GgufQuantMix::kBF16:
      return 32;
    case GgufQuantMix::kF16:
      return 1;
    case GgufQuantMix::kF32:
      return 0;
  }
  return 0;
}

uint32_t GgufTypeFor(GgufQuantMix mix, std::string_view name, int n_dims, int64_t ne0) {
  if (n_dims == 1 || name.ends_with("ffn_gate_inp.weight")) return T(GgmlType::kF32);
  uint32_t type = T(GgmlType::kQ8_0);
  switch (mix) {
    case GgufQuantMix::kQ4_K_M:
    case GgufQuantMix::kQ5_K_M: {
      const uint32_t base = T(mix == GgufQuantMix::kQ4_K_M ? GgmlType::kQ4_K : GgmlType::kQ5_K);
      if (name.ends_with("ffn_gate_exps.weight") || name.ends_with("ffn_up_exps.weight") ||
          name == "token_embd.weight") {
        type = base;
      } else if (name.ends_with("ffn_down_exps.weight") || name == "output.weight") {
        type = T(GgmlType::kQ6_K);
      }
      break;
    }
    case GgufQuantMix::kQ8_0:
      break;
    case GgufQuantMix::kBF16:
      return T(GgmlType::kBF16);
    case GgufQuantMix::kF16:
      return T(GgmlType::kF16);
    case GgufQuantMix::kF32:
      return T(GgmlType::kF32);
  }
  const int64_t block = GgmlTypeSizeOf(type)->block_size;
  if (ne0 % block != 0) type = ne0 % 32 == 0 ? T(GgmlType::kQ8_0) : T(GgmlType::kF16);
  return type;
}

absl::Status WriteGgufModel(const ModelPreset& preset, const std::string& out_dir,
                            const GgufWriteOptions& options) {
  if (options.num_threads < 1) return absl::InvalidArgumentError("num_threads must be >= 1");
  if (options.split_max_bytes < 0) return absl::InvalidArgumentError("split size must be >= 0");
  ModelConfig config = preset.config;
  config.quantization = QuantizationConfig();
  HMOE_RETURN_IF_ERROR(config.Validate());
  HMOE_RETURN_IF_ERROR(PrepareGgufDirectory(out_dir, options.force));

  // Plan the GGUF tensors in ExpectedTensors order (stacked experts at their first expert).
  const std::vector<ExpectedTensor> expected = ExpectedTensors(config);
  std::vector<GgufPlan> plans;
  std::map<std::string, size_t> by_name;
  for (const ExpectedTensor& t : expected) {
    HMOE_ASSIGN_OR_RETURN(const GgufTensorRef ref, GgufNameForHf(t.name, options.split_kv_b));
    std::vector<int64_t> ne(t.shape.rbegin(), t.shape.rend());
    if (ref.expert >= 0) {
      const auto it = by_name.find(ref.gguf_name);
      if (it != by_name.end()) {
        plans[it->second].sources.push_back(&t);
        continue;
      }
      ne.push_back(config.n_routed_experts);
    }
    if (t.name.ends_with(layer_tensor::kKvBProj) && options.split_kv_b) {
      const int64_t nh = config.num_attention_heads, rkv = config.kv_lora_rank;
      const std::string prefix = absl::StrCat("blk.", t.layer, ".");
      plans.push_back(
          {prefix + "attn_k_b.weight", {config.qk_nope_head_dim, rkv, nh}, 0, 0, {&t}, 1});
      plans.push_back({prefix + "attn_v_b.weight", {rkv, config.v_head_dim, nh}, 0, 0, {&t}, 2});
      continue;
    }
    by_name[ref.gguf_name] = plans.size();
    plans.push_back({ref.gguf_name, ne, 0, 0, {&t}, 0});
  }
  for (GgufPlan& p : plans) {
    p.type = GgufTypeFor(options.mix, p.name, static_cast<int>(p.ne.size()), p.ne[0]);
    int64_t n = 1;
    for (int64_t d : p.ne) n *= d;
    HMOE_RETURN_IF_ERROR(GgmlBytes(p.type, n, &p.bytes));
  }
  // Parts.
  std::vector<std::vector<const GgufPlan*>> parts(1);
  size_t part_bytes = 0;
  for (const GgufPlan& p : plans) {
    if (options.split_max_bytes > 0 && !parts.back().empty() &&
        part_bytes + p.bytes > static_cast<size_t>(options.split_max_bytes)) {
      parts.emplace_back();
      part_bytes = 0;
    }
    parts.back().push_back(&p);
    part_bytes += p.bytes;
  }
  // Metadata.
  std::vector<std::pair<std::string, GgufValue>> metadata =
      GgufMetadataForConfig(config, options.split_kv_b, GgufFileType(options.mix));
  const int32_t tokenizer_size =
      static_cast<int32_t>(std::min<int64_t>(preset.tokenizer_vocab_size, config.vocab_size));
  HMOE_ASSIGN_OR_RETURN(const BuiltTokenizer tok,
                        BuildTokenizer(tokenizer_size, config.max_position_embeddings));
  HMOE_ASSIGN_OR_RETURN(
      auto tok_md,
      GgufTokenizerMetadata(tok.tokenizer_json, tok.tokenizer_config_json, config.vocab_size));
  for (auto& kv : tok_md) metadata.push_back(std::move(kv));

  const bool split = options.split_max_bytes > 0;
  for (size_t k = 0; k < parts.size(); ++k) {
    const std::string path = split ? GgufSplitPath(out_dir + "/model", static_cast<int>(k) + 1,
                                                   static_cast<int>(parts.size()))
                                   : out_dir + "/model.gguf";
    GgufWriter writer(path);
    if (k == 0) {
      for (const auto& [key, value] : metadata) writer.AddMetadata(key, value);
    }
    if (split) {
      writer.AddMetadata("split.no", GgufValue::U16(static_cast<uint16_t>(k)));
      writer.AddMetadata("split.count", GgufValue::U16(static_cast<uint16_t>(parts.size())));
      writer.AddMetadata("split.tensors.count", GgufValue::I32(static_cast<int32_t>(plans.size())));
    }
    for (const GgufPlan* p : parts[k])
      HMOE_RETURN_IF_ERROR(writer.AddTensor(p->name, p->ne, p->type));
    HMOE_RETURN_IF_ERROR(writer.Begin());
    for (const GgufPlan* p : parts[k]) {
      HMOE_RETURN_IF_ERROR(WriteTensorValues(*p, config, options, &writer));
    }
    HMOE_RETURN_IF_ERROR(writer.Finish());
    HMOE_VLOG(1) << "wrote " << path << " (" << parts[k].size() << " tensors)";
  }
  return absl::OkStatus();
}

}  // namespace hmoe

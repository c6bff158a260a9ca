#include "tools/model_writer.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "common/base/json.h"
#include "common/base/logging.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/model/dtype.h"
#include "common/model/safetensors.h"
#include "common/model/tensor.h"
#include "tools/tokenizer_builder.h"

namespace hmoe {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kBlock = 128;  // FP8 scale block (weight_block_size)
constexpr int64_t kMiB = int64_t{1} << 20;
// Output buffered per batch of strips (each thread fills part of it).
constexpr int64_t kBatchBytes = 32 * kMiB;

absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// ---------------------------------------------------------------------------------- random

uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t Fnv1a64(std::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001B3ull;
  }
  return h;
}

uint64_t TensorKey(std::string_view name, uint64_t seed) {
  return Mix64(Fnv1a64(name) ^ Mix64(seed + 0x243F6A8885A308D3ull));
}

// ln(x) for x in (0, 1], to ~1e-7 absolute: x = m * 2^e with m in [sqrt(1/2), sqrt(2)), then the
// atanh series of ln(m). Plain float arithmetic (no libm), so results do not depend on the libm.
inline float LogUnit(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const float m1 = std::bit_cast<float>((bits & 0x7FFFFFu) | 0x3F800000u);  // [1, 2)
  const bool halve = m1 > 1.41421356f;  // selects, not branches: the loop calling this vectorizes
  const float m = m1 * (halve ? 0.5f : 1.0f);
  const int e = static_cast<int>((bits >> 23) & 0xFFu) - 127 + (halve ? 1 : 0);
  const float f = m - 1.0f;
  const float t = f / (2.0f + f);  // |t| <= 0.172
  const float t2 = t * t;
  const float series = t2 * (1.0f / 3 + t2 * (1.0f / 5 + t2 * (1.0f / 7 + t2 * (1.0f / 9))));
  return static_cast<float>(e) * 0.69314718056f + 2.0f * t + 2.0f * t * series;
}

// sin and cos of 2*pi*u for u in [0, 1), to ~1e-7: quadrant from 4u, Taylor series on [0, pi/2).
inline void SinCosTurns(float u, float* sin_out, float* cos_out) {
  const float q4 = 4.0f * u;
  const int quadrant = static_cast<int>(q4);
  const float r = (q4 - static_cast<float>(quadrant)) * 1.57079632679f;
  const float r2 = r * r;
  const float s =
      r * (1.0f + r2 * (-1.0f / 6 +
                        r2 * (1.0f / 120 + r2 * (-1.0f / 5040 +
                                                 r2 * (1.0f / 362880 + r2 * (-1.0f / 39916800))))));
  const float c =
      1.0f +
      r2 * (-0.5f + r2 * (1.0f / 24 + r2 * (-1.0f / 720 +
                                            r2 * (1.0f / 40320 + r2 * (-1.0f / 3628800 +
                                                                       r2 * (1.0f / 479001600))))));
  // Rotate by the quadrant without branches (the quadrant is random: branches would mispredict):
  // odd quadrants swap sin and cos; sin is negative in quadrants 2-3, cos in quadrants 1-2.
  const bool odd = (quadrant & 1) != 0;
  const uint32_t sin_sign = static_cast<uint32_t>(quadrant & 2) << 30;
  const uint32_t cos_sign = static_cast<uint32_t>((quadrant + 1) & 2) << 30;
  *sin_out = std::bit_cast<float>(std::bit_cast<uint32_t>(odd ? c : s) ^ sin_sign);
  *cos_out = std::bit_cast<float>(std::bit_cast<uint32_t>(odd ? s : c) ^ cos_sign);
}

// Normals are produced in pairs: pair k of a tensor keyed `key` gives elements 2k and 2k+1, from
// one splitmix64 output (two 24-bit uniforms, Box-Muller; |z| < 5.8).
constexpr int kBatchPairs = 16;

// z[2j], z[2j + 1] = the normals of pair first + j, j < kBatchPairs. Written as fixed-length
// loops over arrays so the float part vectorizes; each value is computed by the same operations
// as one scalar pair would be.
inline void NormalBatch(uint64_t key, uint64_t first, float* z) {
  float u1[kBatchPairs], u2[kBatchPairs], radius[kBatchPairs], sin_a[kBatchPairs],
      cos_a[kBatchPairs];
  for (int j = 0; j < kBatchPairs; ++j) {
    const uint64_t r = Mix64(key + (first + static_cast<uint64_t>(j) + 1) * 0x9E3779B97F4A7C15ull);
    u1[j] = static_cast<float>((r >> 40) + 1) * 0x1p-24f;          // (0, 1]
    u2[j] = static_cast<float>((r >> 16) & 0xFFFFFFu) * 0x1p-24f;  // [0, 1)
  }
  for (int j = 0; j < kBatchPairs; ++j) {
    const float a = -2.0f * LogUnit(u1[j]);  // >= 0 up to rounding
    radius[j] = std::sqrt(a > 0.0f ? a : 0.0f);
  }
  for (int j = 0; j < kBatchPairs; ++j) SinCosTurns(u2[j], &sin_a[j], &cos_a[j]);
  for (int j = 0; j < kBatchPairs; ++j) {
    z[2 * j] = radius[j] * cos_a[j];
    z[2 * j + 1] = radius[j] * sin_a[j];
  }
}

// ---------------------------------------------------------------------------------- threads

// Runs fn(begin, end) over [0, n) split across up to `num_threads` threads. std::thread reports
// failure by throwing; if a thread cannot be started its share runs on the calling thread.
void ParallelFor(int num_threads, int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t parts = std::clamp<int64_t>(num_threads, 1, std::max<int64_t>(n, 1));
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  std::vector<std::jthread> threads;
  std::vector<std::pair<int64_t, int64_t>> inline_ranges;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t begin = n * p / parts, end = n * (p + 1) / parts;
    try {
      threads.emplace_back([&fn, begin, end] { fn(begin, end); });
    } catch (const std::system_error&) {
      inline_ranges.emplace_back(begin, end);
    }
  }
  fn(0, n / parts);
  for (const auto& [begin, end] : inline_ranges) fn(begin, end);
}  // jthreads join here

// ---------------------------------------------------------------------------------- presets

ModelConfig BaseConfig() {
  ModelConfig c;
  c.model_type = "deepseek_v3";
  c.moe_layer_freq = 1;
  c.routed_scaling_factor = 2.5;
  c.scoring_func = "sigmoid";
  c.topk_method = "noaux_tc";
  c.norm_topk_prob = true;
  c.hidden_act = "silu";
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.rope_scaling.enabled = true;
  c.rope_scaling.beta_fast = 32.0;
  c.rope_scaling.beta_slow = 1.0;
  c.rope_scaling.mscale = 1.0;
  c.rope_scaling.mscale_all_dim = 1.0;
  c.bos_token_id = kBuiltBosId;
  c.eos_token_ids = {kBuiltEosId};
  c.tie_word_embeddings = false;
  c.num_nextn_predict_layers = 0;
  c.quantization.fp8 = true;
  c.quantization.block_rows = kBlock;
  c.quantization.block_cols = kBlock;
  return c;
}

// ---------------------------------------------------------------------------------- writing

struct PlannedTensor {
  const ExpectedTensor* t = nullptr;
  DType dtype = DType::kBF16;
  bool has_scale = false;
  int64_t rows = 1;  // 1-D tensors are one row
  int64_t cols = 1;
  size_t data_bytes = 0;   // the tensor itself
  size_t scale_bytes = 0;  // its weight_scale_inv (F32), when has_scale
};

struct Shard {
  std::string file_name;
  std::vector<const PlannedTensor*> tensors;
  size_t bytes = 0;
};

PlannedTensor Plan(const ExpectedTensor& t, bool fp8) {
  PlannedTensor p;
  p.t = &t;
  if (t.shape.size() == 1) {
    p.cols = t.shape[0];
  } else {
    p.rows = t.shape[0];
    p.cols = t.shape[1];
  }
  switch (t.kind) {
    case TensorKind::kLinear:
      p.dtype = fp8 ? DType::kF8E4M3 : DType::kBF16;
      p.has_scale = fp8;
      break;
    case TensorKind::kEmbedding:
    case TensorKind::kRouter:
    case TensorKind::kNorm:
      p.dtype = DType::kBF16;
      break;
    case TensorKind::kBias:
      p.dtype = DType::kF32;
      break;
  }
  p.data_bytes = static_cast<size_t>(p.rows * p.cols) * DTypeSize(p.dtype);
  if (p.has_scale) {
    const int64_t scale_rows = (p.rows + kBlock - 1) / kBlock;
    const int64_t scale_cols = (p.cols + kBlock - 1) / kBlock;
    p.scale_bytes = static_cast<size_t>(scale_rows * scale_cols) * sizeof(float);
  }
  return p;
}

// Converts and stores rows [r0, r1) of `p` (values in `values`, row-major) to `out`, the bytes of
// those rows. For FP8 the rows must be one 128-row strip; its block scales go to `scales`
// (ceil(cols/128) floats).
void EncodeStrip(const PlannedTensor& p, const float* values, int64_t r0, int64_t r1,
                 std::byte* out, float* scales) {
  const int64_t n = (r1 - r0) * p.cols;
  switch (p.dtype) {
    case DType::kF8E4M3: {
      const int64_t col_blocks = (p.cols + kBlock - 1) / kBlock;
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        const int64_t c0 = cb * kBlock, c1 = std::min(p.cols, c0 + kBlock);
        float amax = 0.0f;
        for (int64_t r = 0; r < r1 - r0; ++r) {
          for (int64_t c = c0; c < c1; ++c)
            amax = std::max(amax, std::fabs(values[r * p.cols + c]));
        }
        // Dequantization multiplies by this (weight_scale_inv); the largest magnitude maps to 448.
        const float scale = amax == 0.0f ? 1.0f : std::max(amax / 448.0f, 1e-12f);
        scales[cb] = scale;
        for (int64_t r = 0; r < r1 - r0; ++r) {
          for (int64_t c = c0; c < c1; ++c) {
            // FastFloatToFp8E4M3 == FloatToFp8E4M3 (dtype.h) for every input, only faster.
            out[r * p.cols + c] = static_cast<std::byte>(
                internal::FastFloatToFp8E4M3(values[r * p.cols + c] / scale));
          }
        }
      }
      break;
    }
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t b = FloatToBf16(values[i]);
        std::memcpy(out + 2 * i, &b, 2);  // little-endian host (x86-64)
      }
      break;
    case DType::kF32:
      std::memcpy(out, values, static_cast<size_t>(n) * sizeof(float));
      break;
    default:
      HMOE_CHECK(false) << "unexpected dtype " << DTypeName(p.dtype);
  }
}

// Streams tensor `p` (and its scale) into `writer`.
absl::Status WriteTensor(const PlannedTensor& p, const ModelConfig& config,
                         const WriteOptions& options, SafetensorsWriter* writer) {
  const ExpectedTensor& t = *p.t;
  const int64_t strip_rows = std::min<int64_t>(kBlock, p.rows);
  const int64_t num_strips = (p.rows + strip_rows - 1) / strip_rows;
  const int64_t col_blocks = (p.cols + kBlock - 1) / kBlock;
  const size_t elem = DTypeSize(p.dtype);
  const int64_t strip_bytes = strip_rows * p.cols * static_cast<int64_t>(elem);
  const int64_t strips_per_batch = std::max<int64_t>(1, kBatchBytes / strip_bytes);
  std::vector<float> scales(p.has_scale ? static_cast<size_t>(num_strips * col_blocks) : 0);
  std::vector<std::byte> batch;
  for (int64_t first = 0; first < num_strips; first += strips_per_batch) {
    const int64_t last = std::min(num_strips, first + strips_per_batch);
    const int64_t row_begin = first * strip_rows, row_end = std::min(p.rows, last * strip_rows);
    batch.resize(static_cast<size_t>((row_end - row_begin) * p.cols) * elem);
    ParallelFor(options.num_threads, last - first, [&](int64_t s0, int64_t s1) {
      std::vector<float> values(static_cast<size_t>(strip_rows * p.cols));
      for (int64_t s = first + s0; s < first + s1; ++s) {
        const int64_t r0 = s * strip_rows, r1 = std::min(p.rows, r0 + strip_rows);
        GenerateRows(t, config, options.seed, r0, r1, values.data());
        EncodeStrip(p, values.data(), r0, r1,
                    batch.data() + static_cast<size_t>((r0 - row_begin) * p.cols) * elem,
                    p.has_scale ? scales.data() + s * col_blocks : nullptr);
      }
    });
    HMOE_RETURN_IF_ERROR(writer->WriteTensorData(t.name, std::span<const std::byte>(batch)));
  }
  if (p.has_scale) {
    HMOE_RETURN_IF_ERROR(writer->WriteTensorData(
        ScaleInvName(t.name), std::string_view(reinterpret_cast<const char*>(scales.data()),
                                               scales.size() * sizeof(float))));
  }
  return absl::OkStatus();
}

absl::Status WriteShard(const Shard& shard, const std::string& out_dir, const ModelConfig& config,
                        const WriteOptions& options) {
  std::vector<TensorSpec> specs;
  for (const PlannedTensor* p : shard.tensors) {
    specs.push_back({p->t->name, p->dtype, p->t->shape});
    if (p->has_scale) {
      specs.push_back({ScaleInvName(p->t->name), DType::kF32, ScaleInvShape(p->t->shape)});
    }
  }
  HMOE_ASSIGN_OR_RETURN(
      std::unique_ptr<SafetensorsWriter> writer,
      SafetensorsWriter::Create(out_dir + "/" + shard.file_name, std::move(specs)));
  for (const PlannedTensor* p : shard.tensors) {
    HMOE_RETURN_IF_ERROR(WriteTensor(*p, config, options, writer.get()));
  }
  return writer->Finish();
}

bool IsCheckpointFile(const std::string& name) {
  static constexpr std::string_view kFiles[] = {"config.json",       "generation_config.json",
                                                "tokenizer.json",    "tokenizer_config.json",
                                                "model.safetensors", "model.safetensors.index.json",
                                                "tiktoken.model"};
  for (std::string_view f : kFiles) {
    if (name == f) return true;
  }
  return name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos &&
         name.size() > 12 && name.substr(name.size() - 12) == ".safetensors";
}

// Creates `dir` or checks that it may be written (empty, or `force`: old checkpoint files go).
absl::Status PrepareDirectory(const std::string& dir, bool force) {
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec)) {
      return absl::AlreadyExistsError(absl::StrCat(dir, " exists and is not a directory"));
    }
    std::vector<fs::path> existing;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      existing.push_back(it->path());
    }
    if (ec) return absl::InternalError(absl::StrCat("list ", dir, ": ", ec.message()));
    if (!existing.empty() && !force) {
      return absl::AlreadyExistsError(
          absl::StrCat(dir, " is not empty (", existing.size(), " entries); use --force"));
    }
    for (const fs::path& path : existing) {
      if (!IsCheckpointFile(path.filename().string())) continue;
      fs::remove(path, ec);
      if (ec)
        return absl::InternalError(absl::StrCat("remove ", path.string(), ": ", ec.message()));
    }
    return absl::OkStatus();
  }
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

std::string GenerationConfigJson(const ModelConfig& config) {
  json::Value o = json::Value::Object({
      {"_from_model_config", json::Value::Bool(true)},
      {"bos_token_id", json::Value::Integer(config.bos_token_id)},
      {"eos_token_id",
       json::Value::Integer(config.eos_token_ids.empty() ? kBuiltEosId
                                                         : config.eos_token_ids.front())},
      {"do_sample", json::Value::Bool(true)},
      {"temperature", json::Value::Number(0.6)},
      {"top_p", json::Value::Number(0.95)},
  });
  return json::Serialize(o, 2) + "\n";
}

}  // namespace

namespace internal {

uint8_t FastFloatToFp8E4M3(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return 0x7F;           // NaN
  if (abs_bits >= 0x43E00000u) return sign | 0x7Eu;  // >= 448 (and inf): saturate
  if (abs_bits < 0x3C800000u) {                      // < 2^-6: subnormal range, step 2^-9
    const float scaled = std::bit_cast<float>(abs_bits) * 512.0f;  // exact
    return sign | static_cast<uint8_t>(std::nearbyint(scaled));    // ties to even; 8 -> 0x08
  }
  // Normal: keep 3 of the 23 mantissa bits, round to nearest even (a carry bumps the exponent).
  const uint32_t exponent = (abs_bits >> 23) - 127 + 7;  // 1..15
  uint32_t code = (exponent << 3) | ((abs_bits >> 20) & 7u);
  const uint32_t rest = abs_bits & 0xFFFFFu;
  // Branch-free (the rounding direction is random for random weights).
  code += static_cast<uint32_t>(rest > 0x80000u) |
          (static_cast<uint32_t>(rest == 0x80000u) & (code & 1u));
  if (code > 0x7Eu) code = 0x7Eu;  // rounds up to 480: saturate to 448
  return sign | static_cast<uint8_t>(code);
}

}  // namespace internal

absl::StatusOr<ModelPreset> GetPreset(std::string_view name) {
  ModelPreset p;
  p.name = std::string(name);
  ModelConfig& c = p.config;
  c = BaseConfig();
  if (name == "tiny") {  // MODEL-SPEC 7.1 T1
    c.vocab_size = 1024;
    c.hidden_size = 256;
    c.intermediate_size = 512;
    c.moe_intermediate_size = 128;
    c.num_hidden_layers = 4;
    c.first_k_dense_replace = 1;
    c.num_attention_heads = 4;
    c.q_lora_rank = 64;
    c.kv_lora_rank = 64;
    c.qk_nope_head_dim = 32;
    c.qk_rope_head_dim = 16;
    c.v_head_dim = 32;
    c.n_routed_experts = 16;
    c.n_shared_experts = 1;
    c.num_experts_per_tok = 4;
    c.n_group = 4;
    c.topk_group = 2;
    c.max_position_embeddings = 1024;
    c.rope_scaling.factor = 4.0;
    c.rope_scaling.original_max_position_embeddings = 256;
    p.tokenizer_vocab_size = 1024;
    p.shard_size_bytes = 1 * kMiB;
  } else if (name == "small") {
    // Every FP8 linear's input dim (1024, 256, 128, 512, 2816, 512) is a multiple of 128.
    c.vocab_size = 4096;
    c.hidden_size = 1024;
    c.intermediate_size = 2816;
    c.moe_intermediate_size = 512;
    c.num_hidden_layers = 8;
    c.first_k_dense_replace = 1;
    c.num_attention_heads = 8;
    c.q_lora_rank = 256;
    c.kv_lora_rank = 128;
    c.qk_nope_head_dim = 64;
    c.qk_rope_head_dim = 32;
    c.v_head_dim = 64;
    c.n_routed_experts = 32;
    c.n_shared_experts = 1;
    c.num_experts_per_tok = 4;
    c.n_group = 4;
    c.topk_group = 2;
    c.max_position_embeddings = 8192;
    c.rope_scaling.factor = 4.0;
    c.rope_scaling.original_max_position_embeddings = 2048;
    p.tokenizer_vocab_size = 3000;
    p.shard_size_bytes = 64 * kMiB;
  } else if (name == "real-shaped") {  // DeepSeek-V3 layer shapes, few layers and experts
    c.vocab_size = 4096;
    c.hidden_size = 7168;
    c.intermediate_size = 18432;
    c.moe_intermediate_size = 2048;
    c.num_hidden_layers = 4;
    c.first_k_dense_replace = 1;
    c.num_attention_heads = 128;
    c.q_lora_rank = 1536;
    c.kv_lora_rank = 512;
    c.qk_nope_head_dim = 128;
    c.qk_rope_head_dim = 64;
    c.v_head_dim = 128;
    c.n_routed_experts = 32;
    c.n_shared_experts = 1;
    c.num_experts_per_tok = 8;
    c.n_group = 1;
    c.topk_group = 1;
    c.max_position_embeddings = 163840;
    c.rope_scaling.factor = 40.0;
    c.rope_scaling.original_max_position_embeddings = 4096;
    p.tokenizer_vocab_size = 4000;
    p.shard_size_bytes = 1024 * kMiB;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown preset \"", Av(name), "\" (known: tiny, small, real-shaped)"));
  }
  HMOE_RETURN_IF_ERROR(c.Validate());
  return p;
}

absl::Status ApplyOverrides(const PresetOverrides& overrides, ModelPreset* preset) {
  ModelConfig& c = preset->config;
  if (overrides.vocab_size < 0 || overrides.num_layers < 0 || overrides.experts < 0) {
    return absl::InvalidArgumentError("overrides must be positive");
  }
  if (overrides.vocab_size > 0) {
    if (overrides.vocab_size < kMinBuiltVocabSize) {
      return absl::InvalidArgumentError(absl::StrCat("vocab size ", overrides.vocab_size,
                                                     " is below the tokenizer's minimum ",
                                                     kMinBuiltVocabSize));
    }
    c.vocab_size = overrides.vocab_size;
  }
  preset->tokenizer_vocab_size =
      static_cast<int32_t>(std::min<int64_t>(preset->tokenizer_vocab_size, c.vocab_size));
  if (overrides.num_layers > 0) c.num_hidden_layers = overrides.num_layers;
  if (overrides.experts > 0) c.n_routed_experts = overrides.experts;
  return c.Validate();
}

namespace {

// config.json members of this family that ModelConfig does not model but transformers'
// DeepseekV3Config accepts (ignored by us; written as given).
constexpr std::string_view kOtherConfigKeys[] = {"aux_loss_alpha",
                                                 "ep_size",
                                                 "seq_aux",
                                                 "initializer_range",
                                                 "pretraining_tp",
                                                 "use_cache",
                                                 "attention_dropout",
                                                 "rope_interleave",
                                                 "torch_dtype",
                                                 "dtype",
                                                 "transformers_version",
                                                 "auto_map",
                                                 "pad_token_id",
                                                 "head_dim",
                                                 "_name_or_path"};
constexpr std::string_view kRopeScalingKeys[] = {"type",
                                                 "rope_type",
                                                 "factor",
                                                 "original_max_position_embeddings",
                                                 "beta_fast",
                                                 "beta_slow",
                                                 "mscale",
                                                 "mscale_all_dim",
                                                 "attention_factor",
                                                 "truncate"};

// config.ToJson() with the override's members replacing or adding its own.
absl::StatusOr<json::Value> MergedConfigJson(const ModelConfig& config, const ModelPreset& preset) {
  HMOE_ASSIGN_OR_RETURN(json::Value merged, json::Parse(config.ToJson()));
  for (const auto& [key, text] : preset.config_override) {
    HMOE_ASSIGN_OR_RETURN(json::Value v, json::Parse(text));
    merged.Set(key, std::move(v));
  }
  return merged;
}

}  // namespace

absl::Status ApplyConfigOverride(std::string_view override_json, ModelPreset* preset) {
  auto error = [](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("config override: ", what));
  };
  absl::StatusOr<json::Value> parsed = json::Parse(override_json);
  if (!parsed.ok()) return error(parsed.status().message());
  if (!parsed->is_object()) {
    return error(absl::StrCat("expected a JSON object, got ", json::TypeName(parsed->type())));
  }
  HMOE_ASSIGN_OR_RETURN(const json::Value base, json::Parse(preset->config.ToJson()));
  std::vector<std::pair<std::string, std::string>> members = preset->config_override;
  for (const auto& [key, value] : parsed->members()) {
    const absl::string_view key_view(key.data(), key.size());
    if (key == "quantization_config") {
      return error("field \"quantization_config\" is set by --dtype (fp8 or bf16)");
    }
    if (key == "text_config") {
      return error(
          "field \"text_config\": nested configs are not supported; override the "
          "top-level fields");
    }
    // rope_scaling is always in ToJson's output (null without YaRN), as is every modelled field.
    const bool known = base.Find(key) != nullptr ||
                       std::find(std::begin(kOtherConfigKeys), std::end(kOtherConfigKeys), key) !=
                           std::end(kOtherConfigKeys);
    if (!known) {
      return error(absl::StrCat("unknown field \"", key_view,
                                "\" (not a DeepSeek-V3-family config.json field)"));
    }
    if (key == "rope_scaling" && value.is_object()) {
      for (const auto& [sub, unused] : value.members()) {
        if (std::find(std::begin(kRopeScalingKeys), std::end(kRopeScalingKeys), sub) ==
            std::end(kRopeScalingKeys)) {
          return error(absl::StrCat("unknown field \"rope_scaling.",
                                    absl::string_view(sub.data(), sub.size()), "\""));
        }
      }
    }
    auto it =
        std::find_if(members.begin(), members.end(), [&](const auto& m) { return m.first == key; });
    std::string text = json::Serialize(value);
    if (it != members.end()) {
      it->second = std::move(text);
    } else {
      members.emplace_back(key, std::move(text));
    }
  }
  ModelPreset candidate = *preset;
  candidate.config_override = std::move(members);
  HMOE_ASSIGN_OR_RETURN(const json::Value merged, MergedConfigJson(preset->config, candidate));
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(json::Serialize(merged));
  if (!config.ok()) return error(config.status().message());
  if (config->vocab_size < kMinBuiltVocabSize) {
    return error(absl::StrCat("field \"vocab_size\": ", config->vocab_size,
                              " is below the built tokenizer's minimum ", kMinBuiltVocabSize));
  }
  candidate.config = *std::move(config);
  candidate.tokenizer_vocab_size = static_cast<int32_t>(
      std::min<int64_t>(candidate.tokenizer_vocab_size, candidate.config.vocab_size));
  *preset = std::move(candidate);
  return absl::OkStatus();
}

InitDistribution InitStd(const ExpectedTensor& t, const ModelConfig& config) {
  const float hidden = static_cast<float>(config.hidden_size);
  switch (t.kind) {
    case TensorKind::kEmbedding:
      if (t.name == kLmHeadName) return {0.0f, 3.0f / std::sqrt(hidden)};
      return {0.0f, 1.0f};
    case TensorKind::kNorm:
      return {1.0f, 0.05f};
    case TensorKind::kRouter:
      return {0.0f, 1.0f / std::sqrt(hidden)};
    case TensorKind::kBias:
      return {0.0f, 0.05f};
    case TensorKind::kLinear: {
      const float fan_in = static_cast<float>(t.shape.size() > 1 ? t.shape[1] : t.shape[0]);
      float stddev = 1.0f / std::sqrt(fan_in);
      const bool residual_output =
          t.name.ends_with("o_proj.weight") || t.name.ends_with("down_proj.weight");
      if (residual_output) {
        stddev /= std::sqrt(2.0f * static_cast<float>(config.num_hidden_layers));
      }
      return {0.0f, stddev};
    }
  }
  return {};
}

void GenerateRows(const ExpectedTensor& t, const ModelConfig& config, uint64_t seed,
                  int64_t row_begin, int64_t row_end, float* out) {
  const int64_t cols = t.shape.size() > 1 ? t.shape[1] : t.shape[0];
  const InitDistribution d = InitStd(t, config);
  const uint64_t key = TensorKey(t.name, seed);
  const int64_t begin = row_begin * cols, end = row_end * cols;
  constexpr int64_t kBatch = 2 * kBatchPairs;  // elements per NormalBatch
  float z[kBatch];
  // Batches are aligned to multiples of kBatch elements, so element i always gets the same value.
  for (int64_t base = begin - begin % kBatch; base < end; base += kBatch) {
    NormalBatch(key, static_cast<uint64_t>(base / 2), z);
    const int64_t lo = std::max(base, begin), hi = std::min(base + kBatch, end);
    for (int64_t i = lo; i < hi; ++i) out[i - begin] = d.mean + d.stddev * z[i - base];
  }
}

std::vector<float> GenerateTensor(const ExpectedTensor& t, const ModelConfig& config,
                                  uint64_t seed) {
  const int64_t rows = t.shape.size() > 1 ? t.shape[0] : 1;
  const int64_t cols = t.shape.size() > 1 ? t.shape[1] : t.shape[0];
  std::vector<float> values(static_cast<size_t>(rows * cols));
  GenerateRows(t, config, seed, 0, rows, values.data());
  return values;
}

absl::Status WriteModel(const ModelPreset& preset, const std::string& out_dir,
                        const WriteOptions& options) {
  if (options.num_threads < 1) return absl::InvalidArgumentError("num_threads must be >= 1");
  const int64_t shard_size =
      options.shard_size_bytes > 0 ? options.shard_size_bytes : preset.shard_size_bytes;
  if (shard_size <= 0) return absl::InvalidArgumentError("shard size must be positive");
  ModelConfig config = preset.config;
  config.quantization.fp8 = options.fp8;
  HMOE_RETURN_IF_ERROR(config.Validate());
  const int32_t tokenizer_size =
      static_cast<int32_t>(std::min<int64_t>(preset.tokenizer_vocab_size, config.vocab_size));
  if (options.tokenizer_style == TokenizerStyle::kKimi) {
    // Kimi-K2's config.json names [BOS] and [EOS], the first two ids after the ranks.
    if (tokenizer_size < kMinKimiVocabSize) {
      return absl::InvalidArgumentError(
          absl::StrCat("a Kimi-style tokenizer needs a vocabulary of ", kMinKimiVocabSize, ", not ",
                       tokenizer_size));
    }
    config.bos_token_id = tokenizer_size - kKimiReservedSpecials;
    config.eos_token_ids = {config.bos_token_id + 1};
  }
  HMOE_RETURN_IF_ERROR(PrepareDirectory(out_dir, options.force));

  // Plan: tensors in ExpectedTensors order, packed greedily into shards of <= shard_size bytes.
  const std::vector<ExpectedTensor> expected = ExpectedTensors(config);
  std::vector<PlannedTensor> planned;
  planned.reserve(expected.size());
  for (const ExpectedTensor& t : expected) planned.push_back(Plan(t, options.fp8));
  std::vector<Shard> shards;
  size_t total_size = 0;
  for (const PlannedTensor& p : planned) {
    const size_t bytes = p.data_bytes + p.scale_bytes;
    if (shards.empty() || (!shards.back().tensors.empty() &&
                           shards.back().bytes + bytes > static_cast<size_t>(shard_size))) {
      shards.emplace_back();
    }
    shards.back().tensors.push_back(&p);
    shards.back().bytes += bytes;
    total_size += bytes;
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    shards[i].file_name = absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, shards.size());
  }

  std::vector<std::pair<std::string, std::string>> entries;
  for (const Shard& shard : shards) {
    HMOE_RETURN_IF_ERROR(WriteShard(shard, out_dir, config, options));
    HMOE_VLOG(1) << "wrote " << out_dir << "/" << shard.file_name << " (" << shard.bytes
                 << " bytes, " << shard.tensors.size() << " weights)";
    for (const PlannedTensor* p : shard.tensors) {
      entries.emplace_back(p->t->name, shard.file_name);
      if (p->has_scale) entries.emplace_back(ScaleInvName(p->t->name), shard.file_name);
    }
  }
  std::sort(entries.begin(), entries.end());
  std::vector<std::pair<std::string, json::Value>> members;
  members.reserve(entries.size());
  for (auto& [name, file] : entries) members.emplace_back(name, json::Value::String(file));
  json::Value index = json::Value::Object({
      {"metadata", json::Value::Object(
                       {{"total_size", json::Value::Integer(static_cast<int64_t>(total_size))}})},
      {"weight_map", json::Value::Object(std::move(members))},
  });
  HMOE_RETURN_IF_ERROR(WriteFileAtomically(out_dir + "/model.safetensors.index.json",
                                           json::Serialize(index, 2) + "\n"));
  HMOE_RETURN_IF_ERROR(WriteTokenizerFiles(out_dir, tokenizer_size, config.max_position_embeddings,
                                           options.tokenizer_style));
  HMOE_RETURN_IF_ERROR(
      WriteFileAtomically(out_dir + "/generation_config.json", GenerationConfigJson(config)));
  std::string config_json = config.ToJson();
  if (!preset.config_override.empty()) {
    // The override's members as given (absent rope_scaling keys stay absent), then what this
    // function decides itself: the quantization (options.fp8) and a Kimi tokenizer's BOS/EOS.
    HMOE_ASSIGN_OR_RETURN(json::Value merged, MergedConfigJson(config, preset));
    HMOE_ASSIGN_OR_RETURN(const json::Value own, json::Parse(config_json));
    for (const char* key : {"quantization_config", "bos_token_id", "eos_token_id"}) {
      if (const json::Value* v = own.Find(key)) merged.Set(key, *v);
    }
    config_json = json::Serialize(merged, 2) + "\n";
    HMOE_ASSIGN_OR_RETURN(const ModelConfig reread, ModelConfig::FromJson(config_json));
    if (!(reread == config)) {
      return absl::InternalError(
          "config.json with the override does not read back as the "
          "config the weights were generated for");
    }
  }
  // Last, so that a directory whose writing was interrupted is not a loadable checkpoint.
  return WriteFileAtomically(out_dir + "/config.json", config_json);
}

}  // namespace hmoe

#pragma once

// Writes synthetic DeepSeek-V3-family checkpoints (random weights, real layout) for tests and
// demos: exactly the Hugging Face directory layout of the real model — config.json, sharded
// model-0000i-of-0000N.safetensors plus model.safetensors.index.json, tokenizer.json,
// tokenizer_config.json and generation_config.json. Used by the hmoe-make-model tool and
// in-process by tests.
//
// Weights are a pure function of (seed, tensor name, element index): a counter-based generator
// (splitmix64 keyed by a hash of the tensor name and the seed, Box-Muller on its uniforms), so any
// tensor or block can be regenerated independently, in any order, on any number of threads.
// Scales keep activations in a realistic range through all layers (see InitStd()).

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/model/model_config.h"
#include "common/model/tensor_map.h"
#include "tools/tokenizer_builder.h"

namespace hmoe {

struct ModelPreset {
  std::string name;
  ModelConfig config;                // FP8 quantization_config set; WriteModel drops it for BF16
  int32_t tokenizer_vocab_size = 0;  // <= config.vocab_size; ids beyond are unused rows
  int64_t shard_size_bytes = 0;      // default shard size
  // Members of a --config-override object (ApplyConfigOverride), written into config.json as
  // given so that keys the override leaves out of rope_scaling stay absent. Empty: none.
  std::vector<std::pair<std::string, std::string>> config_override;  // key, serialized value
};

// "tiny" (MODEL-SPEC 7.1 T1, ~6 MB), "small" (a ~400 MB demo that answers quickly on 2 cores),
// "real-shaped" (DeepSeek-V3 layer shapes, 4 layers, 32 experts, vocab 4096, ~6 GB).
// InvalidArgument naming the known presets otherwise.
absl::StatusOr<ModelPreset> GetPreset(std::string_view name);

// Overrides applied to a preset (0 = keep). The tokenizer shrinks with the vocabulary when
// needed. InvalidArgument when the result is not a valid config (e.g. experts not divisible by
// n_group; see ModelConfig::Validate).
struct PresetOverrides {
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  int64_t experts = 0;
};
absl::Status ApplyOverrides(const PresetOverrides& overrides, ModelPreset* preset);

// Replaces or adds config.json fields of a preset (hmoe-make-model --config-override FILE), before
// any weight is generated, so tensor shapes follow: `override_json` is a JSON object whose
// members replace the preset's config.json members of the same name (whole values: an object
// replaces the whole rope_scaling; null is allowed, e.g. "q_lora_rank": null for a single q_proj
// or "rope_scaling": null for plain RoPE). InvalidArgument, naming the problem, when the text is
// not a JSON object, a key is not a config.json field of this family (typos are not silently
// ignored), a rope_scaling key is unknown, quantization_config is given (--dtype decides it) or
// the resulting config is invalid (ModelConfig::FromJson's message). Applies after
// ApplyOverrides' flags when both are used.
absl::Status ApplyConfigOverride(std::string_view override_json, ModelPreset* preset);

struct WriteOptions {
  uint64_t seed = 0;
  // true: FP8 E4M3 linear weights with F32 128x128 weight_scale_inv (as the real checkpoint);
  // false: BF16 everywhere and no quantization_config.
  bool fp8 = true;
  // 0: the preset's default. A tensor larger than this gets a shard of its own.
  int64_t shard_size_bytes = 0;
  // Allows writing into a non-empty directory; previous checkpoint files there (config.json,
  // *.safetensors, the index, tokenizer and generation configs) are removed first. Other files
  // are left alone.
  bool force = false;
  // Generation threads (>= 1).
  int num_threads = 2;
  // kKimi: tiktoken.model + tokenizer_config.json as Kimi-K2 ships them, instead of
  // tokenizer.json (tools/tokenizer_builder.h).
  TokenizerStyle tokenizer_style = TokenizerStyle::kDeepSeek;
};

// Writes the checkpoint to `out_dir` (created if missing). AlreadyExists when `out_dir` is a
// non-empty directory and !force; InvalidArgument for bad options; I/O errors from the writers.
// Byte-identical output for identical arguments.
absl::Status WriteModel(const ModelPreset& preset, const std::string& out_dir,
                        const WriteOptions& options);

// Standard deviation (and mean, 1 for norms, 0 otherwise) of tensor `t`'s initial values:
//   embed_tokens N(0, 1); lm_head N(0, (3/sqrt(H))^2) so logits have std ~3; norms 1 + N(0,
//   0.05^2); router gate N(0, 1/H); e_score_correction_bias N(0, 0.05^2); linear [out, in] N(0,
//   1/in), with o_proj and every down_proj further scaled by 1/sqrt(2 * num_hidden_layers)
//   (residual scaling) so the residual stream grows slowly.
struct InitDistribution {
  float mean = 0.0f;
  float stddev = 1.0f;
};
InitDistribution InitStd(const ExpectedTensor& t, const ModelConfig& config);

// The generated (pre-rounding) values of rows [row_begin, row_end) of tensor `t` (1-D tensors
// have one row), row-major, written to `out` (size (row_end - row_begin) * cols).
void GenerateRows(const ExpectedTensor& t, const ModelConfig& config, uint64_t seed,
                  int64_t row_begin, int64_t row_end, float* out);

// All values of tensor `t` (convenience for tests and small tensors).
std::vector<float> GenerateTensor(const ExpectedTensor& t, const ModelConfig& config,
                                  uint64_t seed);

namespace internal {
// FloatToFp8E4M3 (common/model/dtype.h) by bit manipulation instead of a table search: the same
// code for every input (round to nearest even, saturate to +-448, NaN -> 0x7F), several times
// faster. Exposed for its test.
uint8_t FastFloatToFp8E4M3(float f);
}  // namespace internal

}  // namespace hmoe

#pragma once

// Writes a synthetic DeepSeek-V3-family model as a GGUF (llama.cpp arch "deepseek2"), from the
// same random weights WriteModel writes as safetensors (GenerateRows: the pre-rounding values),
// quantized by our own quantizers (common/model/gguf_quants.h), laid out like the published
// Q4_K_M files. Used by `hmoe-make-model --format gguf` and by tests.

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "tools/model_writer.h"

namespace hmoe {

// Quantization mixes (--quant):
//   q4_k_m: routed gate/up experts and token_embd Q4_K, routed down experts and output Q6_K,
//           everything else 2-D/3-D (attention, shared experts, dense MLP) Q8_0
//   q5_k_m: as q4_k_m with Q5_K instead of Q4_K
//   q8_0:   every matrix Q8_0
//   bf16, f16, f32: every matrix in that type
// Always F32: 1-D tensors (norms, exp_probs_b) and the router (ffn_gate_inp), as llama.cpp.
// A K-quant on a row whose length is not a multiple of 256 falls back to Q8_0 (e.g. tiny's
// routed down experts, rows of 128), as llama-quantize falls back.
enum class GgufQuantMix { kQ4_K_M, kQ5_K_M, kQ8_0, kBF16, kF16, kF32 };
absl::StatusOr<GgufQuantMix> ParseGgufQuantMix(std::string_view name);
// The ggml type of GGUF tensor `gguf_name` with `n_dims` dimensions and rows of `ne0`.
uint32_t GgufTypeFor(GgufQuantMix mix, std::string_view gguf_name, int n_dims, int64_t ne0);
// general.file_type of the mix (llama_ftype: 15 Q4_K_M, 17 Q5_K_M, 7 Q8_0, 32 BF16, 1 F16, 0 F32).
uint32_t GgufFileType(GgufQuantMix mix);

struct GgufWriteOptions {
  uint64_t seed = 0;
  GgufQuantMix mix = GgufQuantMix::kQ4_K_M;
  // true: attn_k_b + attn_v_b (the layout current converters write); false: attn_kv_b.
  bool split_kv_b = true;
  // 0: one file "model.gguf"; else parts "model-0000k-of-0000n.gguf" of at most this many tensor
  // bytes each (a larger tensor gets a part of its own).
  int64_t split_max_bytes = 0;
  bool force = false;  // replace existing model*.gguf files in the directory
  int num_threads = 2;
};

// Writes the model into directory `out_dir` (created if missing; AlreadyExists when it holds
// files and !force). Byte-identical output for identical arguments.
absl::Status WriteGgufModel(const ModelPreset& preset, const std::string& out_dir,
                            const GgufWriteOptions& options);

}  // namespace hmoe

#pragma once

// A GGUF model's weights dequantized to F32 host memory, for the FP32 reference forward
// (hmoe-generate --model FILE.gguf and tests). Holds the whole model in F32: small models only.

#include <memory>
#include <set>
#include <string>

#include "absl/status/statusor.h"

#include "common/model/gguf_model.h"
#include "common/model/model_config.h"
#include "common/model/tensor.h"
#include "tools/in_memory_weights.h"

namespace hmoe {

// Every ExpectedTensors(config) tensor dequantized to F32 under its Hugging Face name and shape:
// a WeightSource the FP32 reference forward (and hmoe-generate --model FILE.gguf) runs on.
// Errors from ValidateGgufTensors first.
absl::StatusOr<std::unique_ptr<InMemoryWeightSource>> LoadGgufAsF32Weights(
    const ModelConfig& config, const GgufModel& model);

// The names of `source`'s tensors held in a GGML block type (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K): the
// weights whose products the served engine computes with Q8_K-rounded activations by default
// (common/ops/cpu/quantized_linear.h), so the reference must round the same activations
// (ReferenceModelOptions::q8k_activation_tensors). `source`: e.g. a GgufCheckpoint.
std::set<std::string> BlockQuantizedTensorNames(const WeightSource& source);

}  // namespace hmoe

// hmoe-generate: greedy generation with the FP32 reference forward pass, for checking engines
// against the oracle on small checkpoints.
//
//   hmoe-generate --model DIR (--prompt-ids 1,2,3 | --prompt TEXT) --max-new-tokens 16
//                 [--mla naive|absorbed] [--print-logits] [--stop-at-eos] [--dump-logits FILE]
//   hmoe-generate --model DIR/model.gguf ...   (a GGUF: weights dequantized to FP32, the GGUF's
//                                              config and tokenizer; docs/gguf.md)
//
// Prints the generated token ids, comma-separated, on one line of stdout. With --prompt (the text
// is encoded with the checkpoint's tokenizer, BOS added when tokenizer_config.json says
// add_bos_token), a second line "text: <decoded continuation>" follows, with newlines, tabs,
// quotes, backslashes and other control characters C-escaped so that it stays one line. With
// --print-logits, one more line per generated token follows: "logits <step>: v0 v1 ...
// v(vocab-1)" (%.9g). With --dump-logits FILE, the logits of every PROMPT position (the prefill)
// are written to FILE as raw little-endian IEEE float32, row-major [num_prompt_tokens,
// vocab_size], no header: row t holds the logits predicting token t + 1. Timing goes to stderr.
// Exit code 0 on success, 1 with a message on stderr on any error.

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "common/base/flags.h"
#include "common/base/status_macros.h"
#include "common/engine/reference/reference_model.h"
#include "common/model/checkpoint.h"
#include "common/model/gguf_model.h"
#include "common/model/gguf_source.h"
#include "common/model/tokenizer.h"
#include "tools/gguf_f32_weights.h"

ABSL_FLAG(std::string, model, "",
          "checkpoint directory (config.json + safetensors), or a GGUF file (*.gguf; any part of "
          "a split model): its weights dequantized to FP32");
ABSL_FLAG(std::string, quant_activations, "q8k",
          "for a GGUF: q8k rounds the activations of its block-quantized weights to Q8_K, as the "
          "served engine does by default (docs/gguf.md); f32 keeps them in FP32 "
          "(HMOE_QUANT_ACTIVATIONS=f32 of the engine)");
ABSL_FLAG(std::string, prompt_ids, "", "comma-separated prompt token ids, e.g. 1,2,3");
ABSL_FLAG(std::string, prompt, "",
          "prompt text, encoded with the checkpoint's tokenizer (instead of --prompt-ids); the "
          "decoded continuation is printed on a second line \"text: ...\"");
ABSL_FLAG(int32_t, max_new_tokens, 16, "number of tokens to generate");
ABSL_FLAG(std::string, mla, "absorbed", "MLA form: naive or absorbed");
ABSL_FLAG(bool, print_logits, false, "also print the logits of every generated token");
ABSL_FLAG(bool, stop_at_eos, false, "stop after the first EOS token (config eos_token_id)");
ABSL_FLAG(std::string, dump_logits, "",
          "write the logits of every prompt position to this file: raw little-endian float32, "
          "row-major [num_prompt_tokens, vocab_size], no header (row t predicts token t+1)");

namespace hmoe {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& text) {
  if (text.empty()) return absl::InvalidArgumentError("--prompt-ids is empty");
  std::vector<int32_t> ids;
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(piece, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--prompt-ids: \"", piece, "\" is not an integer token id"));
    }
    ids.push_back(id);
  }
  return ids;
}

// Writes `values` to `path` as raw little-endian float32 (the host order; checked below).
absl::Status WriteFloats(const std::string& path, std::span<const float> values) {
  static_assert(std::endian::native == std::endian::little, "--dump-logits writes host floats");
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dump-logits: cannot create ", path, ": ", std::strerror(errno)));
  }
  const size_t written = std::fwrite(values.data(), sizeof(float), values.size(), f);
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;
  if (written != values.size() || !closed) {
    return absl::InternalError(absl::StrCat(
        "--dump-logits: writing ", path, " failed: ", std::strerror(closed ? write_errno : errno)));
  }
  return absl::OkStatus();
}

absl::Status Run() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) return absl::InvalidArgumentError("--model is required");
  const std::string prompt_text = absl::GetFlag(FLAGS_prompt);
  const std::string prompt_ids = absl::GetFlag(FLAGS_prompt_ids);
  const bool use_text = !prompt_text.empty();
  if (use_text && !prompt_ids.empty()) {
    return absl::InvalidArgumentError("give either --prompt-ids or --prompt, not both");
  }
  if (!use_text && prompt_ids.empty()) {
    return absl::InvalidArgumentError("--prompt-ids (or --prompt) is required");
  }
  const int32_t max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  if (max_new_tokens < 0) return absl::InvalidArgumentError("--max-new-tokens is negative");
  reference::ReferenceModelOptions options;
  const std::string mla = absl::GetFlag(FLAGS_mla);
  if (mla == "naive") {
    options.mla_form = reference::MlaForm::kNaive;
  } else if (mla != "absorbed") {
    return absl::InvalidArgumentError(
        absl::StrCat("--mla must be naive or absorbed, got \"", mla, "\""));
  }

  std::unique_ptr<GgufModel> gguf;
  if (dir.ends_with(".gguf")) {
    HMOE_ASSIGN_OR_RETURN(gguf, GgufModel::Open(dir));
  }
  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<int32_t> prompt;
  if (use_text) {
    if (gguf != nullptr) {
      HMOE_ASSIGN_OR_RETURN(tokenizer, TokenizerFromGguf(*gguf));
    } else {
      HMOE_ASSIGN_OR_RETURN(tokenizer, Tokenizer::Load(dir));
    }
    prompt = tokenizer->Encode(prompt_text, tokenizer->add_bos_token());
    if (prompt.empty()) return absl::InvalidArgumentError("--prompt encodes to no tokens");
  } else {
    HMOE_ASSIGN_OR_RETURN(prompt, ParseIds(prompt_ids));
  }

  const Clock::time_point load_start = Clock::now();
  std::unique_ptr<reference::ReferenceModel> model;
  if (gguf != nullptr) {
    HMOE_ASSIGN_OR_RETURN(const ModelConfig config, ModelConfigFromGguf(*gguf));
    HMOE_ASSIGN_OR_RETURN(std::unique_ptr<InMemoryWeightSource> weights,
                          LoadGgufAsF32Weights(config, *gguf));
    const std::string quant = absl::GetFlag(FLAGS_quant_activations);
    if (quant == "q8k") {
      HMOE_ASSIGN_OR_RETURN(std::unique_ptr<GgufCheckpoint> served, GgufCheckpoint::Open(dir));
      options.q8k_activation_tensors = BlockQuantizedTensorNames(*served);
    } else if (quant != "f32") {
      return absl::InvalidArgumentError(
          absl::StrCat("--quant_activations must be q8k or f32, got \"", quant, "\""));
    }
    HMOE_ASSIGN_OR_RETURN(model, reference::ReferenceModel::Create(config, *weights, options));
    gguf.reset();
  } else {
    HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::Open(dir));
    HMOE_ASSIGN_OR_RETURN(
        model, reference::ReferenceModel::Create(checkpoint->config(), *checkpoint, options));
  }  // The model holds its own float copies.
  const double load_s = SecondsSince(load_start);

  const Clock::time_point gen_start = Clock::now();
  const std::string dump_path = absl::GetFlag(FLAGS_dump_logits);
  if (!dump_path.empty()) {
    // A prefill of its own: GenerateGreedy keeps only the last position's logits. Same inputs,
    // same deterministic computation, so these rows are the ones generation starts from.
    reference::ReferenceKvCache cache = model->NewCache();
    HMOE_ASSIGN_OR_RETURN(std::vector<float> prefill_logits, model->Forward(prompt, cache));
    HMOE_RETURN_IF_ERROR(WriteFloats(dump_path, prefill_logits));
  }
  std::vector<std::vector<float>> step_logits;
  HMOE_ASSIGN_OR_RETURN(
      std::vector<int32_t> tokens,
      reference::GenerateGreedy(*model, prompt, max_new_tokens,
                                absl::GetFlag(FLAGS_print_logits) ? &step_logits : nullptr));
  const double gen_s = SecondsSince(gen_start);

  if (absl::GetFlag(FLAGS_stop_at_eos)) {
    const std::vector<int64_t>& eos = model->config().eos_token_ids;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (std::find(eos.begin(), eos.end(), tokens[i]) != eos.end()) {
        tokens.resize(i + 1);
        if (step_logits.size() > i + 1) step_logits.resize(i + 1);
        break;
      }
    }
  }

  std::printf("%s\n", absl::StrJoin(tokens, ",").c_str());
  if (tokenizer != nullptr) {
    // Escaped so that the continuation stays on one line (UTF-8 passes through unchanged).
    std::printf("text: %s\n", absl::Utf8SafeCEscape(tokenizer->Decode(tokens)).c_str());
  }
  for (size_t i = 0; i < step_logits.size(); ++i) {
    std::string line = absl::StrCat("logits ", i, ":");
    for (float v : step_logits[i]) absl::StrAppend(&line, " ", absl::StrFormat("%.9g", v));
    std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);
  std::fprintf(stderr,
               "hmoe-generate: load %.3f s; %zu prompt + %d new tokens in %.3f s (%.1f tokens/s)\n",
               load_s, prompt.size(), max_new_tokens, gen_s,
               gen_s > 0 ? (prompt.size() + max_new_tokens) / gen_s : 0.0);
  return absl::OkStatus();
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) {
  hmoe::SetUsage(
      "greedy generation with the FP32 reference model\n"
      "  hmoe-generate --model DIR (--prompt-ids 1,2,3 | --prompt TEXT) --max-new-tokens N\n"
      "                [--mla naive|absorbed] [--print-logits] [--stop-at-eos] "
      "[--dump-logits FILE]\n"
      "Prints the generated ids on one line (plus \"text: <continuation>\", C-escaped, with "
      "--prompt).\n"
      "--dump-logits FILE: the logits of every prompt position, raw little-endian float32,\n"
      "row-major [num_prompt_tokens, vocab_size], no header; row t predicts token t+1.");
  std::vector<std::string> storage;
  std::vector<char*> args = hmoe::NormalizeFlagNames(argc, argv, storage);
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (positional.size() > 1) {
    std::fprintf(stderr, "hmoe-generate: unexpected argument \"%s\"\n", positional[1]);
    return 1;
  }
  const absl::Status status = hmoe::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "hmoe-generate: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

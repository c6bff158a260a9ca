#pragma once

// Builds a small, deterministic byte-level BPE tokenizer in DeepSeek-V3's format, for test and
// demo checkpoints (hmoe-make-model). The vocabulary is trained by BPE on a built-in English-ish
// text (plus numbers, a little code, CJK and emoji, then deterministic pseudo-words if more merges
// are needed) with DeepSeek-V3's pre-tokenizer, so every merge is reachable by Encode.
//
// Id layout of a vocabulary of size N (N >= kMinBuiltVocabSize):
//   0 <｜begin▁of▁sentence｜> (BOS), 1 <｜end▁of▁sentence｜> (EOS), 2 <｜▁pad▁｜> (pad)
//   3 .. 258      the 256 byte tokens, byte b at id 3 + b
//   259 .. N-3    one token per merge, in merge order
//   N-2 <｜User｜>, N-1 <｜Assistant｜>   (added tokens outside model.vocab, as in the real model)
// The same inputs always produce byte-identical files.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/statusor.h"

namespace hmoe {

inline constexpr std::string_view kBosTokenText = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view kEosTokenText = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kPadTokenText = "<｜▁pad▁｜>";
inline constexpr std::string_view kUserTokenText = "<｜User｜>";
inline constexpr std::string_view kAssistantTokenText = "<｜Assistant｜>";
inline constexpr int32_t kBuiltBosId = 0;
inline constexpr int32_t kBuiltEosId = 1;
inline constexpr int32_t kBuiltPadId = 2;
inline constexpr int32_t kBuiltFirstByteId = 3;
// 3 specials + 256 bytes + User + Assistant.
inline constexpr int32_t kMinBuiltVocabSize = 261;
// Training cost grows with the size; larger vocabularies are not useful for synthetic models.
inline constexpr int32_t kMaxBuiltVocabSize = 65536;

struct BuiltTokenizer {
  std::string tokenizer_json;         // Hugging Face tokenizer.json, pretty-printed ("" for Kimi)
  std::string tokenizer_config_json;  // tokenizer_config.json
  std::string tiktoken_model;         // Kimi style only: tiktoken.model
};

// Kimi-K2 style (tiktoken.model + tokenizer_config.json, no tokenizer.json), vocabulary size N:
//   0 .. 255          the byte tokens (rank b for byte b)
//   256 .. N-257      one token per merge of the same training, in merge order (rank = id)
//   N-256 .. N-1      the 256 special slots of tokenization_kimi.py; named (added_tokens_decoder)
//                     at Kimi-K2's offsets: [BOS] +0, [EOS] +1, <|im_end|> +2, ..., [UNK] +254,
//                     [PAD] +255; the others are <|reserved_token_ID|>.
inline constexpr int32_t kKimiReservedSpecials = 256;
inline constexpr int32_t kMinKimiVocabSize = 256 + kKimiReservedSpecials;
// The named specials of Kimi-K2 as (offset after the ranks, content).
inline constexpr std::pair<int32_t, std::string_view> kKimiNamedSpecials[] = {
    {0, "[BOS]"},
    {1, "[EOS]"},
    {2, "<|im_end|>"},
    {3, "<|im_user|>"},
    {4, "<|im_assistant|>"},
    {6, "<|start_header_id|>"},
    {7, "<|end_header_id|>"},
    {9, "[EOT]"},
    {10, "<|im_system|>"},
    {11, "<|tool_calls_section_begin|>"},
    {12, "<|tool_calls_section_end|>"},
    {13, "<|tool_call_begin|>"},
    {14, "<|tool_call_argument_begin|>"},
    {15, "<|tool_call_end|>"},
    {17, "<|im_middle|>"},
    {254, "[UNK]"},
    {255, "[PAD]"},
};
inline std::span<const std::pair<int32_t, std::string_view>> KimiSpecialTokens() {
  return kKimiNamedSpecials;
}

enum class TokenizerStyle {
  kDeepSeek,  // tokenizer.json + tokenizer_config.json (BuildTokenizer)
  kKimi,      // tiktoken.model + tokenizer_config.json (BuildKimiTokenizer)
};

// Builds a tokenizer with exactly `vocab_size` ids. InvalidArgument unless
// kMinBuiltVocabSize <= vocab_size <= kMaxBuiltVocabSize.
absl::StatusOr<BuiltTokenizer> BuildTokenizer(int32_t vocab_size, int64_t model_max_length);
// The Kimi-K2-style tokenizer with exactly `vocab_size` ids. InvalidArgument unless
// kMinKimiVocabSize <= vocab_size <= kMaxBuiltVocabSize.
absl::StatusOr<BuiltTokenizer> BuildKimiTokenizer(int32_t vocab_size, int64_t model_max_length);

// BuildTokenizer, then writes `dir`/tokenizer.json and `dir`/tokenizer_config.json (`dir` must
// exist); with kKimi BuildKimiTokenizer and `dir`/tiktoken.model instead of tokenizer.json.
absl::Status WriteTokenizerFiles(const std::string& dir, int32_t vocab_size,
                                 int64_t model_max_length,
                                 TokenizerStyle style = TokenizerStyle::kDeepSeek);

}  // namespace hmoe

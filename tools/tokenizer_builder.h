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
#include <string>
#include <string_view>

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
  std::string tokenizer_json;         // Hugging Face tokenizer.json, pretty-printed
  std::string tokenizer_config_json;  // tokenizer_config.json
};

// Builds a tokenizer with exactly `vocab_size` ids. InvalidArgument unless
// kMinBuiltVocabSize <= vocab_size <= kMaxBuiltVocabSize.
absl::StatusOr<BuiltTokenizer> BuildTokenizer(int32_t vocab_size, int64_t model_max_length);

// BuildTokenizer, then writes `dir`/tokenizer.json and `dir`/tokenizer_config.json (`dir` must
// exist).
absl::Status WriteTokenizerFiles(const std::string& dir, int32_t vocab_size,
                                 int64_t model_max_length);

}  // namespace hmoe

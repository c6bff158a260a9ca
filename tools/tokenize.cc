// hmoe-tokenize: encodes text with a checkpoint's tokenizer (for debugging and for
// scripts/check_tokenizer.py, which compares it against Hugging Face tokenizers).
//
// Reads one JSON string per line on stdin and prints its token ids (space-separated, no BOS) on
// one line. With --decode, reads lines of space-separated ids and prints each decoded text as a
// JSON string.

#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"

#include "common/base/json.h"
#include "common/model/tokenizer.h"

ABSL_FLAG(std::string, model, "",
          "checkpoint directory holding tokenizer.json (or tiktoken.model, Kimi-K2's form)");
ABSL_FLAG(bool, decode, false, "decode ids instead of encoding text");
ABSL_FLAG(bool, parse_special, true,
          "match special/added tokens in the text (false: encode them as plain text)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<std::unique_ptr<hmoe::Tokenizer>> tokenizer =
      hmoe::Tokenizer::Load(absl::GetFlag(FLAGS_model));
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "hmoe-tokenize: %s\n", tokenizer.status().ToString().c_str());
    return 1;
  }
  const bool decode = absl::GetFlag(FLAGS_decode);
  const bool parse_special = absl::GetFlag(FLAGS_parse_special);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (decode) {
      std::vector<int32_t> ids;
      std::istringstream in(line);
      for (int32_t id = 0; in >> id;) ids.push_back(id);
      std::printf(
          "%s\n",
          hmoe::json::Serialize(hmoe::json::Value::String((*tokenizer)->Decode(ids))).c_str());
      continue;
    }
    absl::StatusOr<hmoe::json::Value> text = hmoe::json::Parse(line);
    if (!text.ok() || !text->is_string()) {
      std::fprintf(stderr, "hmoe-tokenize: expected a JSON string per line\n");
      return 1;
    }
    const std::vector<int32_t> ids =
        (*tokenizer)->Encode(text->as_string(), /*add_bos=*/false, parse_special);
    for (size_t i = 0; i < ids.size(); ++i) std::printf(i == 0 ? "%d" : " %d", ids[i]);
    std::printf("\n");
  }
  return 0;
}

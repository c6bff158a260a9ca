// hmoe_json_bench: our JSON parser (common/base/json.h) against nlohmann/json on a tokenizer.json
// of DeepSeek-V3's size (issue 17: replace json.cc by nlohmann/json unless that is slower on a
// real-size tokenizer.json). A plain program, not Google Benchmark: prints the median of the runs.
//
// The document: 128,000 vocabulary entries and 127,000 merges built like a trained BPE (each new
// token is the concatenation of two earlier ones, in GPT-2 byte-level form, at most 12 bytes),
// 800 added tokens, DeepSeek-V3's pre-tokenizer: ~8 MB, as DeepSeek-V3's tokenizer.json (7.8 MB).
//
// usage: hmoe_json_bench [--runs N] [--write FILE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/base/json.h"
#include "common/base/mapped_file.h"
#include "common/model/tokenizer.h"
#include "common/model/tokenizer_internal.h"

#include <nlohmann/json.hpp>

namespace {

using hmoe::json::Value;

std::string BuildTokenizerJson() {
  std::mt19937_64 rng(17);
  std::vector<std::string> tokens;  // raw bytes
  std::unordered_set<std::string> seen;
  for (int b = 0; b < 256; ++b) {
    tokens.emplace_back(1, static_cast<char>(b));
    seen.insert(tokens.back());
  }
  std::vector<std::pair<int, int>> merges;
  const size_t kVocab = 128000;
  while (tokens.size() < kVocab) {
    const size_t n = tokens.size();
    const size_t left = rng() % n;
    const size_t right = rng() % n;
    if (tokens[left].size() + tokens[right].size() > 12) continue;
    std::string joined = tokens[left] + tokens[right];
    if (!seen.insert(joined).second) continue;
    merges.emplace_back(static_cast<int>(left), static_cast<int>(right));
    tokens.push_back(std::move(joined));
  }
  std::vector<std::pair<std::string, Value>> vocab;
  vocab.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    vocab.emplace_back(hmoe::internal::BytesToByteLevel(tokens[i]),
                       Value::Integer(static_cast<int64_t>(i)));
  }
  Value merges_json = Value::Array();
  for (const auto& [l, r] : merges) {
    merges_json.Append(Value::String(hmoe::internal::BytesToByteLevel(tokens[l]) + " " +
                                     hmoe::internal::BytesToByteLevel(tokens[r])));
  }
  Value added = Value::Array();
  for (int i = 0; i < 800; ++i) {
    added.Append(Value::Object({
        {"id", Value::Integer(static_cast<int64_t>(kVocab) + i)},
        {"content", Value::String("<｜place▁holder▁no▁" + std::to_string(i) + "｜>")},
        {"single_word", Value::Bool(false)},
        {"lstrip", Value::Bool(false)},
        {"rstrip", Value::Bool(false)},
        {"normalized", Value::Bool(true)},
        {"special", Value::Bool(true)},
    }));
  }
  Value pre = Value::Array();
  for (hmoe::internal::SplitRule rule : hmoe::internal::DeepSeekV3Rules()) {
    pre.Append(Value::Object({
        {"type", Value::String("Split")},
        {"pattern", Value::Object({{"Regex", Value::String(std::string(
                                                 hmoe::internal::SplitRuleRegex(rule)))}})},
        {"behavior", Value::String("Isolated")},
        {"invert", Value::Bool(false)},
    }));
  }
  pre.Append(Value::Object({{"type", Value::String("ByteLevel")},
                            {"add_prefix_space", Value::Bool(false)},
                            {"trim_offsets", Value::Bool(true)},
                            {"use_regex", Value::Bool(false)}}));
  Value root = Value::Object({
      {"version", Value::String("1.0")},
      {"added_tokens", std::move(added)},
      {"normalizer",
       Value::Object({{"type", Value::String("Sequence")}, {"normalizers", Value::Array()}})},
      {"pre_tokenizer",
       Value::Object({{"type", Value::String("Sequence")}, {"pretokenizers", std::move(pre)}})},
      {"decoder", Value::Object({{"type", Value::String("ByteLevel")}})},
      {"model", Value::Object({
                    {"type", Value::String("BPE")},
                    {"dropout", Value::Null()},
                    {"vocab", Value::Object(std::move(vocab))},
                    {"merges", std::move(merges_json)},
                })},
  });
  return hmoe::json::Serialize(root, 1);
}

template <typename F>
double MedianSeconds(int runs, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 5;
  const char* write = nullptr;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--runs") == 0) runs = std::max(1, std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "--write") == 0) write = argv[i + 1];
  }
  const std::string text = BuildTokenizerJson();
  if (write != nullptr && !hmoe::WriteFileAtomically(write, text).ok()) return 1;
  size_t sink = 0;
  const double ours = MedianSeconds(runs, [&] {
    absl::StatusOr<Value> v = hmoe::json::Parse(text);
    if (!v.ok()) std::abort();
    sink += v->Find("model")->Find("vocab")->members().size();
  });
  const double nlohmann_s = MedianSeconds(runs, [&] {
    const nlohmann::json v = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (v.is_discarded()) std::abort();
    sink += v["model"]["vocab"].size();
  });
  const double load = MedianSeconds(runs, [&] {
    auto t = hmoe::Tokenizer::FromJson(text, "");
    if (!t.ok()) {
      std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
      std::abort();
    }
    sink += (*t)->vocab_size();
  });
  std::printf("tokenizer.json: %.2f MB, 128000 vocab, 127744 merges, 800 added tokens\n",
              text.size() / 1e6);
  std::printf(
      "median of %d: hmoe::json::Parse %.3f s, nlohmann::json::parse %.3f s "
      "(nlohmann / ours = %.2f); Tokenizer::FromJson (parse + build) %.3f s  [%zu]\n",
      runs, ours, nlohmann_s, nlohmann_s / ours, load, sink % 10);
  return 0;
}

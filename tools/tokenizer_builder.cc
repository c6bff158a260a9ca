#include "tools/tokenizer_builder.h"

#include <algorithm>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

#include "common/base/json.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/model/tokenizer_internal.h"

namespace hmoe {
namespace {

// The training text. Its merges come first (it is weighted most), so common English words,
// whitespace runs and punctuation get their own tokens.
constexpr std::string_view kTrainingText =
    R"TEXT(The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step, and the first step is often the hardest one to take.
Once upon a time there was a small village at the edge of a great forest. The people of the village were farmers and hunters, and they lived simple lives. Every morning the sun rose over the hills, and every evening it set behind the mountains. The children played in the fields while their parents worked, and the old men told stories about the days when the river still ran through the center of the town.
In the beginning, the computer was a machine that filled an entire room. Today, a phone in your pocket has more memory and more computing power than all of the computers that sent people to the moon. What will the next fifty years bring? Nobody knows, but many people believe that learning machines will change the way we work, the way we write, and the way we think about ourselves.
"Where are you going?" she asked. "I am going to the market," he said, "to buy some bread, some cheese and a bottle of milk." She smiled and said that she would come with him, because she needed new shoes and a warm coat for the winter.
The weather today is sunny with a high of 24 degrees and a low of 12 degrees. Tomorrow there is a 30% chance of rain in the afternoon. The wind will blow from the north at 15 km/h. On Monday, March 3rd, 2025, the temperature will drop to 5 degrees, and there may be snow in the mountains above 1,200 meters.
Question: What is the capital of France? Answer: The capital of France is Paris. Question: How many days are there in a year? Answer: There are 365 days in a year, or 366 days in a leap year. Question: Who wrote the play Hamlet? Answer: William Shakespeare wrote Hamlet around the year 1600.
A good recipe for pancakes: mix two cups of flour, two eggs, one cup of milk, a pinch of salt and a spoon of sugar. Heat a pan with a little butter, pour in the batter, and cook each side until it is golden brown. Serve with fresh fruit, honey or maple syrup.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

int main(int argc, char** argv) {
  std::vector<int> values = {1, 2, 3, 4, 5};
  for (int value : values) {
    std::cout << value << std::endl;
  }
  return 0;
}
The history of science is a history of questions. Why does the apple fall from the tree? Why do the planets move around the sun? What is light made of? Each answer opened new questions, and each new question led to new experiments, new theories and new tools. Scientists learned to measure, to count and to compare, and they learned that a good theory must make predictions that can be tested.
Dear customer, thank you for your order. Your package has been shipped and should arrive within three to five business days. If you have any questions, please contact our support team by email or by phone. We are happy to help you, and we hope you enjoy your purchase!
Music, art and literature help people understand each other. A song can make you feel happy or sad, a painting can show you a world you have never seen, and a book can let you live a thousand lives. That is why every culture in the world has its own stories, its own songs and its own art.
The model answered the question correctly, but it took a long time to think. The user asked for a shorter answer, so the assistant tried again and wrote only one sentence. Good assistants are helpful, honest and clear; they explain what they know and say when they are not sure.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 512 1024 2048 4096 65536 3.14159 2.71828 -1 +42 1e-6 0x7f 50/50 99.9% $19.99 #1 @home
Punctuation: ... !!! ??? --- *** ### (a) [b] {c} <d> a, b; c: d! e? f. "quoted" 'single' `code` ~tilde ^caret |pipe| \back/slash_under&and=equals
你好，世界！今天天气很好。我们一起去公园散步吧。
こんにちは、世界。ありがとうございます。カタカナとひらがな。
안녕하세요 세계. Привет, мир! Γειά σου κόσμε. Ça va très bien, merci. Größe über Straße. ¿Qué tal? ¡Hola!
Emoji: 😀 😂 🙂 🎉 👍 ❤️ 🚀 ✨ 🌍 🔥
)TEXT";

constexpr int64_t kTrainingTextWeight = 64;

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Deterministic pseudo-English text: `num_words` words of 1-4 consonant-vowel syllables, with
// occasional capitals, commas and periods. Supplies merges beyond what the training text holds.
std::string PseudoText(uint64_t seed, int num_words) {
  static constexpr std::string_view kOnsets[] = {
      "b", "c", "d",  "f",  "g",  "h",  "j",  "k",  "l",  "m",  "n",  "p",  "r",  "s",  "t",  "v",
      "w", "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr", "qu", ""};
  static constexpr std::string_view kVowels[] = {"a",  "e",  "i",  "o",  "u",  "y",
                                                 "ai", "ea", "ee", "ie", "oo", "ou"};
  static constexpr std::string_view kCodas[] = {"",  "",  "",   "n",  "r",  "s",  "t",
                                                "l", "m", "nd", "st", "ng", "ck", "x"};
  std::string text;
  uint64_t state = seed;
  for (int w = 0; w < num_words; ++w) {
    const uint64_t r = SplitMix64(&state);
    std::string word;
    const int syllables = 1 + static_cast<int>(r % 4);
    for (int s = 0; s < syllables; ++s) {
      const uint64_t q = SplitMix64(&state);
      word.append(kOnsets[q % std::size(kOnsets)]);
      word.append(kVowels[(q >> 8) % std::size(kVowels)]);
      word.append(kCodas[(q >> 16) % std::size(kCodas)]);
    }
    if ((r >> 8) % 7 == 0) word[0] = static_cast<char>(word[0] - 'a' + 'A');
    text.push_back(' ');
    text.append(word);
    if ((r >> 16) % 11 == 0) text.push_back(',');
    if ((r >> 24) % 13 == 0) text.append(".\n");
  }
  return text;
}

// BPE training state: unique words as symbol sequences with counts, pair counts, and a max-heap
// of pairs. Heap entries are upper bounds of their pair's count: an increase pushes a new entry,
// a decrease is applied lazily (the stale entry is re-pushed with the current count when popped).
class Trainer {
 public:
  Trainer() {
    for (int b = 0; b < 256; ++b) {
      token_bytes_.push_back(std::string(1, static_cast<char>(b)));
      known_.insert(token_bytes_.back());
    }
  }

  // Adds the pre-tokenized pieces of `text`, each counted `weight` times.
  void AddText(std::string_view text, int64_t weight) {
    std::map<std::string_view, int64_t> counts;  // ordered: deterministic word indices
    for (std::string_view piece : internal::PreTokenize(text, internal::DeepSeekV3Rules())) {
      counts[piece] += weight;
    }
    Deltas deltas;
    for (const auto& [piece, count] : counts) {
      const auto [it, inserted] = word_index_.emplace(std::string(piece), words_.size());
      if (inserted) {
        Word word;
        for (char c : piece) word.symbols.push_back(static_cast<uint8_t>(c));
        words_.push_back(std::move(word));
      }
      Word& word = words_[it->second];
      word.count += count;
      for (size_t i = 0; i + 1 < word.symbols.size(); ++i) {
        const Pair p(word.symbols[i], word.symbols[i + 1]);
        deltas[p] += count;
        pair_words_[p].push_back(it->second);
      }
    }
    ApplyDeltas(deltas);
  }

  // Performs the best merge; false when no pair is left. Best = highest count, ties broken by
  // the bytes of the left then the right token (deterministic regardless of hash order). A pair
  // whose concatenation already is a token (reachable through another merge path) is never
  // merged, so tokens and merges stay one to one and no token string repeats.
  bool MergeOnce(std::pair<int32_t, int32_t>* merged) {
    Pair pair;
    while (true) {
      if (heap_.empty()) return false;
      std::pop_heap(heap_.begin(), heap_.end(), HeapLess{this});
      const HeapEntry top = heap_.back();
      heap_.pop_back();
      const auto it = pair_counts_.find(top.pair);
      if (it == pair_counts_.end()) continue;
      if (it->second < top.count) {  // decreased since pushed: re-rank
        Push(top.pair, it->second);
        continue;
      }
      if (known_.count(token_bytes_[top.pair.first] + token_bytes_[top.pair.second]) > 0) {
        pair_counts_.erase(it);  // banned: never pushed again (its count only ever drops)
        continue;
      }
      pair = top.pair;
      break;
    }
    const int32_t new_token = static_cast<int32_t>(token_bytes_.size());
    token_bytes_.push_back(token_bytes_[pair.first] + token_bytes_[pair.second]);
    known_.insert(token_bytes_.back());
    std::vector<size_t> affected = std::move(pair_words_[pair]);
    pair_words_.erase(pair);
    std::sort(affected.begin(), affected.end());
    affected.erase(std::unique(affected.begin(), affected.end()), affected.end());
    Deltas deltas;
    std::vector<int32_t> out;
    for (size_t w : affected) {
      Word& word = words_[w];
      std::vector<int32_t>& s = word.symbols;
      out.clear();
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == pair.first && s[i + 1] == pair.second) {
          out.push_back(new_token);
          ++i;
        } else {
          out.push_back(s[i]);
        }
      }
      if (out.size() == s.size()) continue;  // stale index entry
      for (size_t i = 0; i + 1 < s.size(); ++i) deltas[Pair(s[i], s[i + 1])] -= word.count;
      for (size_t i = 0; i + 1 < out.size(); ++i) {
        const Pair p(out[i], out[i + 1]);
        deltas[p] += word.count;
        if (p.first == new_token || p.second == new_token) pair_words_[p].push_back(w);
      }
      s.swap(out);
    }
    ApplyDeltas(deltas);
    pair_counts_.erase(pair);
    *merged = pair;
    return true;
  }

  const std::string& token_bytes(int32_t token) const { return token_bytes_[token]; }

 private:
  using Pair = std::pair<int32_t, int32_t>;
  struct PairHash {
    size_t operator()(const Pair& p) const {
      return std::hash<uint64_t>()((static_cast<uint64_t>(p.first) << 32) ^
                                   static_cast<uint32_t>(p.second));
    }
  };
  // Ordered so that heap pushes happen in a deterministic order.
  using Deltas = std::map<Pair, int64_t>;
  struct Word {
    std::vector<int32_t> symbols;
    int64_t count = 0;
  };
  struct HeapEntry {
    int64_t count;
    Pair pair;
  };
  // Heap order: the top is the highest count, then the smallest (left, right) token bytes.
  struct HeapLess {
    const Trainer* trainer;
    bool operator()(const HeapEntry& a, const HeapEntry& b) const {
      if (a.count != b.count) return a.count < b.count;
      return trainer->LessPair(b.pair, a.pair);
    }
  };

  bool LessPair(const Pair& a, const Pair& b) const {
    const std::string& al = token_bytes_[a.first];
    const std::string& bl = token_bytes_[b.first];
    if (al != bl) return al < bl;
    return token_bytes_[a.second] < token_bytes_[b.second];
  }

  void Push(const Pair& p, int64_t count) {
    heap_.push_back({count, p});
    std::push_heap(heap_.begin(), heap_.end(), HeapLess{this});
  }

  void ApplyDeltas(const Deltas& deltas) {
    for (const auto& [p, delta] : deltas) {
      if (delta == 0) continue;
      const bool banned = known_.count(token_bytes_[p.first] + token_bytes_[p.second]) > 0;
      if (banned) continue;
      int64_t& count = pair_counts_[p];
      count += delta;
      if (count <= 0) {
        pair_counts_.erase(p);
      } else if (delta > 0) {
        Push(p, count);
      }
    }
  }

  std::vector<std::string> token_bytes_;   // training token id -> bytes (0..255 are the bytes)
  std::unordered_set<std::string> known_;  // bytes of every token
  std::vector<Word> words_;
  std::unordered_map<std::string, size_t> word_index_;
  std::unordered_map<Pair, int64_t, PairHash> pair_counts_;
  std::unordered_map<Pair, std::vector<size_t>, PairHash> pair_words_;
  std::vector<HeapEntry> heap_;
};

json::Value AddedTokenJson(int32_t id, std::string_view content) {
  return json::Value::Object({
      {"id", json::Value::Integer(id)},
      {"content", json::Value::String(std::string(content))},
      {"single_word", json::Value::Bool(false)},
      {"lstrip", json::Value::Bool(false)},
      {"rstrip", json::Value::Bool(false)},
      {"normalized", json::Value::Bool(false)},
      {"special", json::Value::Bool(true)},
  });
}

json::Value ConfigTokenJson(std::string_view content) {
  return json::Value::Object({
      {"__type", json::Value::String("AddedToken")},
      {"content", json::Value::String(std::string(content))},
      {"lstrip", json::Value::Bool(false)},
      {"normalized", json::Value::Bool(true)},
      {"rstrip", json::Value::Bool(false)},
      {"single_word", json::Value::Bool(false)},
  });
}

json::Value SplitJson(internal::SplitRule rule) {
  return json::Value::Object({
      {"type", json::Value::String("Split")},
      {"pattern", json::Value::Object({{"Regex", json::Value::String(std::string(
                                                     internal::SplitRuleRegex(rule)))}})},
      {"behavior", json::Value::String("Isolated")},
      {"invert", json::Value::Bool(false)},
  });
}

json::Value ByteLevelJson(bool add_prefix_space, bool trim_offsets, bool use_regex) {
  return json::Value::Object({
      {"type", json::Value::String("ByteLevel")},
      {"add_prefix_space", json::Value::Bool(add_prefix_space)},
      {"trim_offsets", json::Value::Bool(trim_offsets)},
      {"use_regex", json::Value::Bool(use_regex)},
  });
}

// TemplateProcessing that prepends BOS, as transformers' LlamaTokenizerFast sets up for
// add_bos_token = true.
json::Value PostProcessorJson() {
  const auto special = [](int type_id) {
    return json::Value::Object(
        {{"SpecialToken", json::Value::Object({
                              {"id", json::Value::String(std::string(kBosTokenText))},
                              {"type_id", json::Value::Integer(type_id)},
                          })}});
  };
  const auto sequence = [](std::string_view id, int type_id) {
    return json::Value::Object(
        {{"Sequence", json::Value::Object({{"id", json::Value::String(std::string(id))},
                                           {"type_id", json::Value::Integer(type_id)}})}});
  };
  return json::Value::Object({
      {"type", json::Value::String("TemplateProcessing")},
      {"single", json::Value::Array({special(0), sequence("A", 0)})},
      {"pair", json::Value::Array({special(0), sequence("A", 0), special(1), sequence("B", 1)})},
      {"special_tokens",
       json::Value::Object(
           {{std::string(kBosTokenText),
             json::Value::Object({
                 {"id", json::Value::String(std::string(kBosTokenText))},
                 {"ids", json::Value::Array({json::Value::Integer(kBuiltBosId)})},
                 {"tokens", json::Value::Array({json::Value::String(std::string(kBosTokenText))})},
             })}})},
  });
}

// A DeepSeek-V3-style chat template (MODEL-SPEC 6.3), simplified: system messages first (joined
// by blank lines), then <｜User｜>content and <｜Assistant｜>content<｜end▁of▁sentence｜>.
std::string ChatTemplate() {
  const std::string user(kUserTokenText), assistant(kAssistantTokenText), eos(kEosTokenText);
  return "{% set ns = namespace(system_prompt='', is_first_sp=true) %}"
         "{%- for message in messages %}{%- if message['role'] == 'system' %}"
         "{%- if ns.is_first_sp %}{% set ns.system_prompt = message['content'] %}"
         "{% set ns.is_first_sp = false %}"
         "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}"
         "{%- endif %}{%- endif %}{%- endfor %}"
         "{{ bos_token }}{{ ns.system_prompt }}"
         "{%- for message in messages %}"
         "{%- if message['role'] == 'user' %}{{ '" +
         user +
         "' + message['content'] }}"
         "{%- elif message['role'] == 'assistant' %}{{ '" +
         assistant + "' + message['content'] + '" + eos +
         "' }}"
         "{%- endif %}{%- endfor %}"
         "{% if add_generation_prompt %}{{ '" +
         assistant + "' }}{% endif %}";
}

// Trains `num_merges` merges into `trainer`; `merges` receives them as (left, right) training
// token ids (training token t >= 256 is the (t-256)-th merge).
void Train(int32_t num_merges, Trainer* trainer, std::vector<std::pair<int32_t, int32_t>>* merges) {
  trainer->AddText(kTrainingText, kTrainingTextWeight);
  std::string numbers;
  for (int i = 0; i < 1000; ++i) absl::StrAppend(&numbers, " ", i, i % 10 == 9 ? "\n" : "");
  trainer->AddText(numbers, 2);
  uint64_t pseudo_seed = 1;
  trainer->AddText(PseudoText(pseudo_seed, 4 * num_merges + 1000), 1);
  merges->reserve(num_merges);
  while (static_cast<int32_t>(merges->size()) < num_merges) {
    std::pair<int32_t, int32_t> merged;
    if (trainer->MergeOnce(&merged)) {
      merges->push_back(merged);
    } else {
      trainer->AddText(PseudoText(++pseudo_seed, 4 * num_merges + 1000), 1);  // more words
    }
  }
}

// A Kimi-K2-style chat template (the turn markers of Kimi-K2's published template, simplified):
// <|im_system|>system<|im_middle|>...<|im_end|>, then a user/assistant turn per message and the
// assistant header for the generation prompt.
std::string KimiChatTemplate() {
  return "{%- for message in messages -%}"
         "{%- if loop.first and message['role'] != 'system' -%}"
         "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
         "{%- endif -%}"
         "{%- if message['role'] == 'system' -%}<|im_system|>"
         "{%- elif message['role'] == 'user' -%}<|im_user|>"
         "{%- else -%}<|im_assistant|>{%- endif -%}"
         "{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
         "{%- endfor -%}"
         "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}";
}

}  // namespace

absl::StatusOr<BuiltTokenizer> BuildKimiTokenizer(int32_t vocab_size, int64_t model_max_length) {
  if (vocab_size < kMinKimiVocabSize || vocab_size > kMaxBuiltVocabSize) {
    return absl::InvalidArgumentError(absl::StrCat("Kimi-style tokenizer vocab size ", vocab_size,
                                                   " outside [", kMinKimiVocabSize, ", ",
                                                   kMaxBuiltVocabSize, "]"));
  }
  const int32_t num_base = vocab_size - kKimiReservedSpecials;
  Trainer trainer;
  std::vector<std::pair<int32_t, int32_t>> merges;
  Train(num_base - 256, &trainer, &merges);

  // tiktoken.model: byte b has rank b, the i-th merged token rank 256 + i.
  BuiltTokenizer built;
  for (int32_t t = 0; t < num_base; ++t) {
    absl::StrAppend(&built.tiktoken_model, absl::Base64Escape(trainer.token_bytes(t)), " ", t,
                    "\n");
  }
  std::vector<std::pair<std::string, json::Value>> decoder;
  for (const auto& [offset, content] : KimiSpecialTokens()) {
    decoder.emplace_back(absl::StrCat(num_base + offset),
                         json::Value::Object({
                             {"content", json::Value::String(std::string(content))},
                             {"lstrip", json::Value::Bool(false)},
                             {"normalized", json::Value::Bool(false)},
                             {"rstrip", json::Value::Bool(false)},
                             {"single_word", json::Value::Bool(false)},
                             {"special", json::Value::Bool(true)},
                         }));
  }
  json::Value additional = json::Value::Array();
  for (std::string_view token :
       {"<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>",
        "[EOT]", "<|im_system|>", "<|im_middle|>"}) {
    additional.Append(json::Value::String(std::string(token)));
  }
  json::Value config = json::Value::Object({
      {"added_tokens_decoder", json::Value::Object(std::move(decoder))},
      {"additional_special_tokens", std::move(additional)},
      {"auto_map",
       json::Value::Object(
           {{"AutoTokenizer",
             json::Value::Array({json::Value::String("tokenization_kimi.TikTokenTokenizer"),
                                 json::Value::Null()})}})},
      {"bos_token", json::Value::String("[BOS]")},
      {"clean_up_tokenization_spaces", json::Value::Bool(false)},
      {"eos_token", json::Value::String("[EOS]")},
      {"model_max_length", json::Value::Integer(model_max_length)},
      {"pad_token", json::Value::String("[PAD]")},
      {"tokenizer_class", json::Value::String("TikTokenTokenizer")},
      {"unk_token", json::Value::String("[UNK]")},
      {"chat_template", json::Value::String(KimiChatTemplate())},
  });
  built.tokenizer_config_json = json::Serialize(config, 2) + "\n";
  return built;
}

absl::StatusOr<BuiltTokenizer> BuildTokenizer(int32_t vocab_size, int64_t model_max_length) {
  if (vocab_size < kMinBuiltVocabSize || vocab_size > kMaxBuiltVocabSize) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer vocab size ", vocab_size,
                                                   " outside [", kMinBuiltVocabSize, ", ",
                                                   kMaxBuiltVocabSize, "]"));
  }
  const int32_t num_merges = vocab_size - kMinBuiltVocabSize;
  Trainer trainer;
  std::vector<std::pair<int32_t, int32_t>> merges;
  Train(num_merges, &trainer, &merges);

  // Training token t -> final id: bytes at 3 + b, merges after them.
  const auto final_id = [](int32_t t) { return kBuiltFirstByteId + t; };
  const auto token_string = [&](int32_t t) {
    return internal::BytesToByteLevel(trainer.token_bytes(t));
  };

  std::vector<std::pair<std::string, json::Value>> vocab;
  vocab.reserve(vocab_size);
  vocab.emplace_back(std::string(kBosTokenText), json::Value::Integer(kBuiltBosId));
  vocab.emplace_back(std::string(kEosTokenText), json::Value::Integer(kBuiltEosId));
  vocab.emplace_back(std::string(kPadTokenText), json::Value::Integer(kBuiltPadId));
  const int32_t num_tokens = 256 + num_merges;
  for (int32_t t = 0; t < num_tokens; ++t) {
    vocab.emplace_back(token_string(t), json::Value::Integer(final_id(t)));
  }
  json::Value merges_json = json::Value::Array();
  for (const auto& [left, right] : merges) {
    merges_json.Append(
        json::Value::String(absl::StrCat(token_string(left), " ", token_string(right))));
  }
  const int32_t user_id = vocab_size - 2;
  const int32_t assistant_id = vocab_size - 1;

  json::Value pre_tokenizer = json::Value::Object({
      {"type", json::Value::String("Sequence")},
      {"pretokenizers", json::Value::Array({
                            SplitJson(internal::SplitRule::kDigits3),
                            SplitJson(internal::SplitRule::kCjkKana),
                            SplitJson(internal::SplitRule::kDeepSeekV3),
                            ByteLevelJson(false, true, false),
                        })},
  });
  json::Value model = json::Value::Object({
      {"type", json::Value::String("BPE")},
      {"dropout", json::Value::Null()},
      {"unk_token", json::Value::Null()},
      {"continuing_subword_prefix", json::Value::Null()},
      {"end_of_word_suffix", json::Value::Null()},
      {"fuse_unk", json::Value::Bool(false)},
      {"byte_fallback", json::Value::Bool(false)},
      {"vocab", json::Value::Object(std::move(vocab))},
      {"merges", std::move(merges_json)},
  });
  json::Value tokenizer = json::Value::Object({
      {"version", json::Value::String("1.0")},
      {"truncation", json::Value::Null()},
      {"padding", json::Value::Null()},
      {"added_tokens", json::Value::Array({
                           AddedTokenJson(kBuiltBosId, kBosTokenText),
                           AddedTokenJson(kBuiltEosId, kEosTokenText),
                           AddedTokenJson(kBuiltPadId, kPadTokenText),
                           AddedTokenJson(user_id, kUserTokenText),
                           AddedTokenJson(assistant_id, kAssistantTokenText),
                       })},
      {"normalizer", json::Value::Null()},
      {"pre_tokenizer", std::move(pre_tokenizer)},
      {"post_processor", PostProcessorJson()},
      {"decoder", ByteLevelJson(true, true, true)},
      {"model", std::move(model)},
  });

  json::Value config = json::Value::Object({
      {"add_bos_token", json::Value::Bool(true)},
      {"add_eos_token", json::Value::Bool(false)},
      {"bos_token", ConfigTokenJson(kBosTokenText)},
      {"clean_up_tokenization_spaces", json::Value::Bool(false)},
      {"eos_token", ConfigTokenJson(kEosTokenText)},
      {"legacy", json::Value::Bool(true)},
      {"model_max_length", json::Value::Integer(model_max_length)},
      {"pad_token", ConfigTokenJson(kPadTokenText)},
      {"sp_model_kwargs", json::Value::Object()},
      {"unk_token", json::Value::Null()},
      {"tokenizer_class", json::Value::String("LlamaTokenizerFast")},
      {"chat_template", json::Value::String(ChatTemplate())},
  });

  BuiltTokenizer built;
  built.tokenizer_json = json::Serialize(tokenizer, 2) + "\n";
  built.tokenizer_config_json = json::Serialize(config, 2) + "\n";
  return built;
}

absl::Status WriteTokenizerFiles(const std::string& dir, int32_t vocab_size,
                                 int64_t model_max_length, TokenizerStyle style) {
  if (style == TokenizerStyle::kKimi) {
    HMOE_ASSIGN_OR_RETURN(BuiltTokenizer built, BuildKimiTokenizer(vocab_size, model_max_length));
    HMOE_RETURN_IF_ERROR(WriteFileAtomically(dir + "/tiktoken.model", built.tiktoken_model));
    return WriteFileAtomically(dir + "/tokenizer_config.json", built.tokenizer_config_json);
  }
  HMOE_ASSIGN_OR_RETURN(BuiltTokenizer built, BuildTokenizer(vocab_size, model_max_length));
  HMOE_RETURN_IF_ERROR(WriteFileAtomically(dir + "/tokenizer.json", built.tokenizer_json));
  return WriteFileAtomically(dir + "/tokenizer_config.json", built.tokenizer_config_json);
}

}  // namespace hmoe

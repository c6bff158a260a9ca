#pragma once

// A byte-level BPE tokenizer that reads a Hugging Face tokenizer.json (model.type "BPE", as
// DeepSeek-V3/R1 ship it) plus tokenizer_config.json.
//
// Encode: added tokens (special or not) are matched first, exactly, leftmost-longest, on the raw
// text; the text between them is split by the pre-tokenizer, each piece is mapped to GPT-2
// byte-level characters and merged by BPE in merge-rank order (lowest rank first, leftmost on
// ties), exactly as Hugging Face tokenizers does.
//
// Supported tokenizer.json features (anything else is rejected with InvalidArgument rather than
// silently tokenized differently):
//   - normalizer: null, or a Sequence with no normalizers.
//   - pre_tokenizer: null, ByteLevel, or a Sequence of Split and ByteLevel steps, where each Split
//     uses behavior "Isolated", invert false, and one of the regexes of DeepSeek-V3's
//     pre-tokenizer (\p{N}{1,3}; the CJK/kana run; the main rule; see SplitRule in
//     tokenizer_internal.h). ByteLevel must have add_prefix_space false; use_regex true adds
//     GPT-2's split rule.
//   - model: type "BPE", vocab, merges as "a b" strings or ["a", "b"] pairs, ignore_merges;
//     dropout must be null or 0; unk_token/byte_fallback are not needed by byte-level BPE (a byte
//     whose token is missing from the vocab is dropped, as Hugging Face does without unk_token).
//   - added_tokens: id, content, special, lstrip, rstrip (single_word and normalized are read but
//     not applied: there is no normalizer, and DeepSeek's tokens have single_word false).
//   - decoder: ByteLevel (or null); post_processor is ignored (BOS is added by Encode's add_bos).
//
// Or a tiktoken checkpoint as Kimi-K2 ships it (docs/tokenizer.md): tiktoken.model (one line per
// token: its bytes in base64, a space, its rank = id) with the pre-tokenizer pattern of
// tokenization_kimi.py (internal::KimiPattern) and special tokens from tokenizer_config.json's
// added_tokens_decoder (ids of the 256 reserved slots after the ranks that it does not name are
// "<|reserved_token_ID|>", as tokenization_kimi.py fills them). Encoding is tiktoken's: specials
// matched exactly (no lstrip/rstrip), a pre-token piece that is a token is that token, otherwise
// its bytes are merged pairwise, always the adjacent pair whose concatenation has the lowest
// rank (leftmost on ties).
//
// The pre-tokenizer regexes are implemented by hand as scanners over code points (no regex
// library). Their \p{L}/\p{M}/\p{N}/\p{P}/\p{S}, letter case, \p{Han} and \s classes are exact
// for Unicode 16.0 (generated table); code points assigned later classify as "other".

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

#include "common/model/tokenizer_internal.h"

namespace hmoe {

// Immutable after loading; all const methods are thread-safe.
class Tokenizer {
 public:
  // Loads `model_dir`/tokenizer.json (or, without it, `model_dir`/tiktoken.model: FromTiktoken)
  // and `model_dir`/tokenizer_config.json (optional:
  // without it there is no BOS/EOS/pad and add_bos_token() is false). NotFound when
  // tokenizer.json is missing; InvalidArgument naming the problem for malformed or unsupported
  // content (bad JSON, unknown model type, a merge referencing an unknown token, duplicate ids, a
  // bos/eos token that is not in the vocabulary, ...).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& model_dir);
  // Same from file contents; `tokenizer_config_json` may be empty (no config).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(
      std::string_view tokenizer_json, std::string_view tokenizer_config_json);
  // A tiktoken tokenizer (Kimi-K2's form) from tiktoken.model and tokenizer_config.json
  // contents (the config may be empty: then only the 256 reserved specials exist). Load() uses
  // it when `model_dir` has tiktoken.model and no tokenizer.json. InvalidArgument naming the line
  // for a malformed tiktoken.model (bad base64, a rank that is not an integer, duplicate tokens or
  // ranks) and for a special token whose id a rank already uses.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromTiktoken(
      std::string_view tiktoken_model, std::string_view tokenizer_config_json);

  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Token ids of `text` (any bytes; UTF-8 expected). With `add_bos` and a known BOS, the BOS id
  // comes first. With `parse_special` false, added/special token strings in `text` are tokenized
  // as plain text (use this for untrusted user content that must not inject control tokens).
  // Time O(n log n) in the text's length n (linear pre-tokenizing and added-token matching, BPE
  // with a heap over a linked list of symbols), whatever the text: docs/tokenizer.md.
  std::vector<int32_t> Encode(std::string_view text, bool add_bos, bool parse_special = true) const;

  // Encode with a limit, for untrusted input such as a prompt that must fit the context: the ids
  // when there are at most `max_tokens` of them (BOS included), std::nullopt as soon as it is known
  // that there are more. It stops at the first pre-token piece that passes the limit, and skips a
  // piece outright when its length in bytes alone implies too many tokens (no token is longer than
  // the longest vocabulary entry), so a huge over-long text costs little more than pre-tokenizing.
  std::optional<std::vector<int32_t>> EncodeWithin(std::string_view text, bool add_bos,
                                                   bool parse_special, size_t max_tokens) const;

  // The text of `ids`, always valid UTF-8: byte-level tokens are mapped back to bytes, added
  // tokens contribute their content (none when `skip_special_tokens` and the token is special),
  // ill-formed UTF-8 becomes U+FFFD (one per maximal ill-formed subpart). Ids without a token
  // (negative, beyond the vocabulary, or holes such as the unused rows of a padded embedding)
  // contribute nothing.
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // Incremental decoding for streaming: the concatenation of every Push() result and the final
  // Flush() equals Decode() of all the ids pushed, and every returned string is valid UTF-8 that
  // never ends inside a multi-byte character (an incomplete character is held until its
  // remaining bytes arrive). Holds a pointer to the tokenizer, which must outlive it.
  // Thread-compatible.
  class StreamDecoder {
   public:
    explicit StreamDecoder(const Tokenizer* tokenizer, bool skip_special_tokens = false)
        : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}
    // Text completed by `id` (possibly empty).
    std::string Push(int32_t id);
    // Whatever is held (an incomplete character becomes U+FFFD); resets the decoder.
    std::string Flush();

   private:
    const Tokenizer* tokenizer_;
    bool skip_special_tokens_;
    std::string pending_;
  };
  StreamDecoder NewStreamDecoder(bool skip_special_tokens = false) const {
    return StreamDecoder(this, skip_special_tokens);
  }

  // One past the largest token id (vocab and added tokens). The model's embedding may have more
  // rows than this.
  int32_t vocab_size() const { return static_cast<int32_t>(id_to_token_.size()); }
  // -1 when unknown (no tokenizer_config.json or the field is null).
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  int32_t pad_id() const { return pad_id_; }
  // tokenizer_config.json's add_bos_token (false when absent).
  bool add_bos_token() const { return add_bos_token_; }
  // tokenizer_config.json's chat_template (Jinja source; not interpreted here), or "".
  const std::string& chat_template() const { return chat_template_; }
  int64_t model_max_length() const { return model_max_length_; }

  // The token string as written in tokenizer.json (byte-level form for BPE tokens, e.g. "Ġthe"),
  // or "" for an id without a token.
  std::string_view IdToToken(int32_t id) const;
  // The raw bytes token `id` decodes to ("" for an id without a token).
  std::string_view IdToBytes(int32_t id) const;
  // The id of a token string (BPE vocabulary or added token).
  std::optional<int32_t> TokenToId(std::string_view token) const;
  // True for added tokens flagged "special".
  bool IsSpecial(int32_t id) const;
  // Number of merges in the BPE model.
  size_t num_merges() const { return merges_.size(); }

 private:
  struct AddedToken {
    std::string content;
    int32_t id = 0;
    bool special = false;
    bool lstrip = false;
    bool rstrip = false;
  };
  struct Merge {
    int32_t rank = 0;
    int32_t new_id = 0;
  };
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
  };
  // A matched added token: bytes [begin, end) of the text, including stripped whitespace.
  struct AddedMatch {
    size_t begin = 0;
    size_t end = 0;
    int32_t id = 0;
  };

  Tokenizer() = default;
  absl::Status ParseTokenizerJson(std::string_view text);
  absl::Status ParseConfigJson(std::string_view text);
  absl::Status ParseTiktoken(std::string_view model, std::string_view config);
  // Builds added_trie_* from added_.
  void BuildAddedTrie();
  // The added token that matches at `pos`, longest first; nullptr when none.
  // Walks the trie of added tokens: O(length of the longest token that is a prefix there).
  const AddedToken* MatchAddedAt(std::string_view text, size_t pos) const;
  std::vector<AddedMatch> FindAddedTokens(std::string_view text) const;
  // Encode's body; false (ids incomplete) once more than `max_tokens` ids are certain.
  bool EncodeLimited(std::string_view text, bool add_bos, bool parse_special, size_t max_tokens,
                     std::vector<int32_t>* ids) const;
  bool EncodeText(std::string_view text, size_t max_tokens, std::vector<int32_t>* ids) const;
  void EncodePiece(std::string_view piece, std::vector<int32_t>* ids) const;

  std::vector<std::string> id_to_token_;
  std::vector<std::string> id_to_bytes_;
  std::vector<uint8_t> is_special_;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> token_to_id_;
  std::unordered_map<uint64_t, Merge> merges_;  // key: (left id << 32) | right id
  int32_t byte_ids_[256] = {};
  bool ignore_merges_ = false;
  // tiktoken form only: raw token bytes -> id of the ranked (non-special) tokens, for the whole
  // piece lookup (ignore_merges_).
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> piece_to_id_;
  bool tiktoken_ = false;
  std::vector<internal::SplitRule> rules_;
  std::vector<AddedToken> added_;
  // A byte trie of the added tokens' contents: node 0 is the root; the child of node n by byte b is
  // added_trie_next_[(n << 8) | b]; added_trie_token_[n] is the added_ index whose content ends at
  // node n, or -1.
  std::unordered_map<uint64_t, int32_t> added_trie_next_;
  std::vector<int32_t> added_trie_token_;
  // The longest byte string of any token: a piece of n bytes has at least ceil(n / it) BPE tokens
  // when every byte has a token (all_bytes_have_tokens_).
  size_t max_token_bytes_ = 1;
  bool all_bytes_have_tokens_ = false;

  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t pad_id_ = -1;
  bool add_bos_token_ = false;
  std::string chat_template_;
  int64_t model_max_length_ = 0;
};

}  // namespace hmoe

#pragma once

// The model's chat template: loaded from a checkpoint (tokenizer_config.json's `chat_template`,
// a string or the list of named templates, or a chat_template.jinja beside it) or from a file,
// and rendered the way Hugging Face transformers' apply_chat_template renders it
// (docs/chat_templates.md).

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

#include "common/chat/jinja.h"

#include <nlohmann/json.hpp>

namespace hmoe::chat {

struct ChatRequest {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  // The tools' JSON schemas (OpenAI's `tools`); null when the request has none.
  nlohmann::ordered_json tools = nullptr;
  bool add_generation_prompt = true;
  // Further template variables, e.g. {"enable_thinking": true} or {"thinking": false}; they
  // override the built-in ones like transformers' **kwargs do.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
};

class ChatTemplate {
 public:
  // `path` is a checkpoint directory or a tokenizer_config.json. A chat_template.jinja in the
  // directory wins over tokenizer_config.json's `chat_template` (as in transformers). bos/eos
  // come from tokenizer_config.json (a string or an {"content": ...} object).
  static absl::StatusOr<ChatTemplate> FromCheckpoint(const std::string& path);

  // A template file (the --chat-template override); the tokens are the checkpoint's.
  static absl::StatusOr<ChatTemplate> FromFile(const std::string& template_path,
                                               std::optional<std::string> bos_token,
                                               std::optional<std::string> eos_token);

  static absl::StatusOr<ChatTemplate> FromString(std::string_view source,
                                                 std::optional<std::string> bos_token,
                                                 std::optional<std::string> eos_token);

  // Renders the prompt text. A template's raise_exception(msg) gives InvalidArgument(msg)
  // (jinja::IsRaisedByTemplate tells it apart); a malformed request InvalidArgument too.
  absl::StatusOr<std::string> Render(const ChatRequest& request) const;

  // The template variables Render passes (for tests and the conformance harness).
  nlohmann::ordered_json Context(const ChatRequest& request) const;

  const std::optional<std::string>& bos_token() const { return bos_token_; }
  const std::optional<std::string>& eos_token() const { return eos_token_; }

 private:
  ChatTemplate() = default;

  // Named templates ("default", "tool_use", ...); a single template is "default".
  std::map<std::string, jinja::Template> templates_;
  std::optional<std::string> bos_token_, eos_token_;
};

}  // namespace hmoe::chat

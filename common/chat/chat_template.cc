#include "common/chat/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"

namespace hmoe::chat {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return ss.str();
}

// A special token in tokenizer_config.json: "text", {"content": "text", ...} or null.
absl::StatusOr<std::optional<std::string>> SpecialToken(const nlohmann::ordered_json& config,
                                                        const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return std::optional<std::string>(c->get<std::string>());
  }
  return absl::InvalidArgumentError(absl::StrCat("tokenizer_config.json: '", key,
                                                 "' is neither a string nor {\"content\": ...}"));
}

absl::StatusOr<jinja::Template> Compile(std::string_view source, const std::string& what) {
  auto t = jinja::Template::Parse(source);
  if (!t.ok()) return Annotate(t.status(), what);
  return t;
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::FromString(std::string_view source,
                                                      std::optional<std::string> bos_token,
                                                      std::optional<std::string> eos_token) {
  ChatTemplate ct;
  HMOE_ASSIGN_OR_RETURN(jinja::Template t, Compile(source, "chat template"));
  ct.templates_.emplace("default", std::move(t));
  ct.bos_token_ = std::move(bos_token);
  ct.eos_token_ = std::move(eos_token);
  return ct;
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromFile(const std::string& template_path,
                                                    std::optional<std::string> bos_token,
                                                    std::optional<std::string> eos_token) {
  HMOE_ASSIGN_OR_RETURN(std::string source, ReadFile(template_path));
  auto ct = FromString(source, std::move(bos_token), std::move(eos_token));
  if (!ct.ok()) return Annotate(ct.status(), template_path);
  return ct;
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromCheckpoint(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool is_dir = fs::is_directory(path, ec);
  const fs::path dir = is_dir ? fs::path(path) : fs::path(path).parent_path();
  const std::string config_path = is_dir ? (dir / "tokenizer_config.json").string() : path;
  HMOE_ASSIGN_OR_RETURN(std::string text, ReadFile(config_path));
  nlohmann::ordered_json config =
      nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(config_path, ": not a JSON object"));
  }
  ChatTemplate ct;
  HMOE_ASSIGN_OR_RETURN(ct.bos_token_, SpecialToken(config, "bos_token"));
  HMOE_ASSIGN_OR_RETURN(ct.eos_token_, SpecialToken(config, "eos_token"));
  const fs::path jinja_file = dir / "chat_template.jinja";
  if (fs::exists(jinja_file, ec)) {
    HMOE_ASSIGN_OR_RETURN(std::string source, ReadFile(jinja_file.string()));
    HMOE_ASSIGN_OR_RETURN(jinja::Template t, Compile(source, jinja_file.string()));
    ct.templates_.emplace("default", std::move(t));
    return ct;
  }
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) {
    return absl::NotFoundError(absl::StrCat(config_path, " has no chat_template"));
  }
  if (it->is_string()) {
    HMOE_ASSIGN_OR_RETURN(jinja::Template t,
                          Compile(it->get<std::string>(), config_path + ": chat_template"));
    ct.templates_.emplace("default", std::move(t));
    return ct;
  }
  if (!it->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path, ": chat_template is neither a string nor a list"));
  }
  for (const auto& entry : *it) {
    auto name = entry.find("name");
    auto tmpl = entry.find("template");
    if (!entry.is_object() || name == entry.end() || !name->is_string() || tmpl == entry.end() ||
        !tmpl->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          config_path, ": each chat_template entry must be {\"name\": str, \"template\": str}"));
    }
    const std::string n = name->get<std::string>();
    HMOE_ASSIGN_OR_RETURN(
        jinja::Template t,
        Compile(tmpl->get<std::string>(), absl::StrCat(config_path, ": chat_template '", n, "'")));
    ct.templates_.insert_or_assign(n, std::move(t));
  }
  if (!ct.templates_.count("default")) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path, ": chat_template lists named templates but none is 'default'"));
  }
  return ct;
}

nlohmann::ordered_json ChatTemplate::Context(const ChatRequest& request) const {
  // The keyword arguments transformers' render_jinja_template passes, in its order.
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = request.messages;
  ctx["tools"] = request.tools;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = request.add_generation_prompt;
  if (bos_token_) ctx["bos_token"] = *bos_token_;
  if (eos_token_) ctx["eos_token"] = *eos_token_;
  if (request.extra.is_object()) {
    for (const auto& [k, v] : request.extra.items()) ctx[k] = v;
  }
  return ctx;
}

absl::StatusOr<std::string> ChatTemplate::Render(const ChatRequest& request) const {
  if (!request.messages.is_array()) {
    return absl::InvalidArgumentError("messages must be a list");
  }
  if (!request.tools.is_null() && !request.tools.is_array()) {
    return absl::InvalidArgumentError("tools must be a list");
  }
  if (!request.extra.is_object()) {
    return absl::InvalidArgumentError("extra template variables must be an object");
  }
  // transformers picks the "tool_use" template when tools are given and one exists.
  auto it = templates_.end();
  if (!request.tools.is_null()) it = templates_.find("tool_use");
  if (it == templates_.end()) it = templates_.find("default");
  return it->second.Render(Context(request));
}

}  // namespace hmoe::chat

// libFuzzer target: a chat template and a conversation through chat::ChatTemplate. The input is
// the template source, or the template + a NUL byte + JSON: a message array, or an object with
// "messages", "tools", "add_generation_prompt" and further template variables (anything else is
// passed as the messages, so malformed requests are exercised too). A template that loads is
// rendered; parsing and rendering must end in a value or an InvalidArgument (the engine's
// nesting, range() and repetition limits keep both bounded), never a crash or an exception.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"

#include "common/chat/chat_template.h"

#include "nlohmann/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view source(reinterpret_cast<const char*>(data), size);
  std::string_view json_text = R"([{"role": "user", "content": "Hi"}])";
  if (const size_t nul = source.find('\0'); nul != std::string_view::npos) {
    json_text = source.substr(nul + 1);
    source = source.substr(0, nul);
  }
  auto tmpl = hmoe::chat::ChatTemplate::FromString(source, "<bos>", "<eos>");
  if (!tmpl.ok()) {
    if (tmpl.status().code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
    return 0;
  }
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(json_text, nullptr,
                                                           /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  hmoe::chat::ChatRequest request;
  if (j.is_object() && j.contains("messages")) {
    for (auto& [key, value] : j.items()) {
      if (key == "messages") {
        request.messages = value;
      } else if (key == "tools") {
        request.tools = value;
      } else if (key == "add_generation_prompt" && value.is_boolean()) {
        request.add_generation_prompt = value.get<bool>();
      } else {
        request.extra[key] = value;
      }
    }
  } else {
    request.messages = j;
  }
  auto text = tmpl->Render(request);
  if (!text.ok() && text.status().code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
  return 0;
}

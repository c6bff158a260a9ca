#pragma once

// A small Jinja template engine for chat templates (docs/chat_templates.md).
//
// It covers the subset of Jinja2 that published chat templates use and renders it the way
// Hugging Face transformers' apply_chat_template does: jinja2 with trim_blocks, lstrip_blocks,
// the loopcontrols extension (break/continue), keep_trailing_newline off, a `tojson` filter that
// is Python's json.dumps (ensure_ascii=False by default, keys in insertion order) and the global
// raise_exception(msg). A template is lexed and parsed to an AST at load time; every construct
// outside the subset (a statement, filter, test, global function or method the engine does not
// implement) is an InvalidArgument error naming the template line. Rendering errors (a type
// error, an undefined value used as a container, raise_exception) are InvalidArgument too.

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include <nlohmann/json.hpp>

namespace hmoe::jinja {

namespace internal {
struct Program;
}  // namespace internal

class Template {
 public:
  // Lexes and parses `source`; InvalidArgument "chat template line N: ..." on a syntax error or
  // an unsupported construct.
  static absl::StatusOr<Template> Parse(std::string_view source);

  // Renders with the top-level variables of `context` (a JSON object). JSON values keep their
  // key order (json.dumps of a Python dict built by json.loads keeps it too). A Template is
  // immutable: concurrent Render calls are safe.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;

 private:
  explicit Template(std::shared_ptr<const internal::Program> program)
      : program_(std::move(program)) {}
  std::shared_ptr<const internal::Program> program_;
};

// True when `status` came from the template calling raise_exception(msg); its message is then
// exactly msg (the template's own words for the caller, e.g. an HTTP 400 body).
bool IsRaisedByTemplate(const absl::Status& status);

// Python's json.dumps(value, ensure_ascii=..., indent=None, separators=None, sort_keys=...):
// ", " and ": " separators, floats as Python's repr. Exposed for tests.
std::string PyJsonDumps(const nlohmann::ordered_json& value, bool ensure_ascii = false,
                        bool sort_keys = false);

}  // namespace hmoe::jinja

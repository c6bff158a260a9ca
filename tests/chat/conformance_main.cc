// Renders the cases gen_conformance.py wrote with our engine and compares them byte for byte
// with what Python's jinja2 (configured as transformers configures it) rendered.
//
//   hmoe_chat_conformance CASES.json
//
// CASES.json: {"checkpoints": {name: dir}, "cases": [{"checkpoint": name, "request":
// {messages, tools, add_generation_prompt, extra}, "expected": text} or {..., "error": msg}
// (raise_exception's message) or {..., "fails": why} (jinja2 failed otherwise)]}.
// Prints a line per checkpoint with its case count; exits 1 on the first few mismatches.

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "common/chat/chat_template.h"
#include "common/chat/jinja.h"

namespace {

// The first differing byte and some context on both sides, for the report.
std::string Diff(const std::string& want, const std::string& got) {
  size_t k = 0;
  while (k < want.size() && k < got.size() && want[k] == got[k]) ++k;
  const size_t from = k > 40 ? k - 40 : 0;
  std::ostringstream os;
  os << "first difference at byte " << k << " (want " << want.size() << " bytes, got " << got.size()
     << ")\n  want: ..." << nlohmann::json(want.substr(from, 120)).dump() << "\n  got:  ..."
     << nlohmann::json(got.substr(from, 120)).dump();
  return os.str();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CASES.json\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot open %s\n", argv[1]);
    return 2;
  }
  nlohmann::ordered_json all = nlohmann::ordered_json::parse(in, nullptr, false);
  if (all.is_discarded() || !all.contains("checkpoints") || !all.contains("cases")) {
    std::fprintf(stderr, "%s: not a conformance case file\n", argv[1]);
    return 2;
  }
  std::map<std::string, hmoe::chat::ChatTemplate> templates;
  for (const auto& [name, dir] : all["checkpoints"].items()) {
    auto t = hmoe::chat::ChatTemplate::FromCheckpoint(dir.get<std::string>());
    if (!t.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), t.status().ToString().c_str());
      return 1;
    }
    templates.emplace(name, *std::move(t));
  }
  std::map<std::string, int> passed, total;
  int failures = 0;
  int index = 0;
  for (const auto& c : all["cases"]) {
    const std::string name = c["checkpoint"].get<std::string>();
    const auto& r = c["request"];
    hmoe::chat::ChatRequest req;
    req.messages = r["messages"];
    req.tools = r["tools"];
    req.add_generation_prompt = r["add_generation_prompt"].get<bool>();
    req.extra = r["extra"];
    auto got = templates.at(name).Render(req);
    ++total[name];
    std::string problem;
    if (c.contains("fails")) {
      // jinja2 itself failed (e.g. a TypeError): we must fail too, not render something.
      if (got.ok())
        problem = "jinja2 failed (" + c["fails"].get<std::string>() + ") but we rendered";
    } else if (c.contains("error")) {
      const std::string want = c["error"].get<std::string>();
      if (got.ok()) {
        problem = "jinja2 raised '" + want + "' but we rendered";
      } else if (!hmoe::jinja::IsRaisedByTemplate(got.status()) ||
                 std::string(got.status().message()) != want) {
        problem = "want raise_exception('" + want + "'), got " + got.status().ToString();
      }
    } else if (!got.ok()) {
      problem = "render failed: " + got.status().ToString();
    } else if (*got != c["expected"].get<std::string>()) {
      problem = Diff(c["expected"].get<std::string>(), *got);
    }
    if (problem.empty()) {
      ++passed[name];
    } else if (++failures <= 5) {
      std::fprintf(stderr, "MISMATCH %s case %d: %s\n", name.c_str(), index, problem.c_str());
    }
    ++index;
  }
  for (const auto& [name, n] : total) {
    std::printf("%-16s %d/%d byte-identical to jinja2\n", name.c_str(), passed[name], n);
  }
  if (failures > 0) {
    std::fprintf(stderr, "%d of %d cases differ\n", failures, index);
    return 1;
  }
  return 0;
}

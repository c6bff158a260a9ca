// hmoe-generate as a real process on the tiny checkpoint (written in-process by the model-writer
// library): deterministic greedy ids, naive == absorbed MLA, --dump-logits layout, --prompt
// text, and bad input (exit code 1 with a message naming the problem). The binary path comes
// from $<TARGET_FILE:hmoe-generate>.

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include <gtest/gtest.h>

#include "common/model/tokenizer.h"
#include "tests/integration/child_process.h"
#include "tools/model_writer.h"

namespace hmoe {
namespace {

using ::hmoe::testing::ChildOptions;
using ::hmoe::testing::ChildProcess;

constexpr char kGenerate[] = HMOE_GENERATE_PATH;

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n');
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  return lines;
}

// Parses "a,b,c" into ids; fails the test on anything else.
std::vector<int64_t> ParseIds(const std::string& line) {
  std::vector<int64_t> ids;
  for (absl::string_view piece : absl::StrSplit(line, ',')) {
    int64_t id = 0;
    EXPECT_TRUE(absl::SimpleAtoi(piece, &id)) << "not an id: \"" << piece << "\" in " << line;
    ids.push_back(id);
  }
  return ids;
}

std::vector<float> ReadFloats(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> values(bytes.size() / sizeof(float));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
  EXPECT_EQ(bytes.size() % sizeof(float), 0u) << path;
  return values;
}

class GenerateCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string tmpl =
        absl::StrCat(base != nullptr && *base ? base : "/tmp", "/hmoe_gencli.XXXXXX");
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
    dir_ = new std::string(tmpl);
    absl::StatusOr<ModelPreset> preset = GetPreset("tiny");
    ASSERT_TRUE(preset.ok()) << preset.status();
    vocab_ = preset->config.vocab_size;
    WriteOptions options;
    options.seed = 0;
    const absl::Status written = WriteModel(*preset, Model(), options);
    ASSERT_TRUE(written.ok()) << written;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
    dir_ = nullptr;
  }

  static std::string Model() { return absl::StrCat(*dir_, "/tiny"); }
  static std::string File(const std::string& name) { return absl::StrCat(*dir_, "/", name); }

  // Runs hmoe-generate with `args` to completion.
  static RunResult Run(std::vector<std::string> args) {
    static int counter = 0;
    const std::string tag = absl::StrCat("run", ++counter);
    ChildOptions options;
    options.argv = {kGenerate};
    options.argv.insert(options.argv.end(), args.begin(), args.end());
    options.stdout_path = File(tag + ".out");
    options.stderr_path = File(tag + ".err");
    RunResult result;
    absl::StatusOr<ChildProcess> child = ChildProcess::Start(std::move(options));
    EXPECT_TRUE(child.ok()) << child.status();
    if (!child.ok()) return result;
    absl::StatusOr<int> code = child->WaitForExit(std::chrono::seconds(120));
    EXPECT_TRUE(code.ok()) << code.status();
    result.exit_code = code.value_or(-1);
    result.out = child->ReadStdout();
    result.err = child->ReadStderr();
    return result;
  }

  // Runs a command that must fail: exit code 1, nothing on stdout, and a stderr message that
  // contains `needle`.
  static void ExpectFailure(std::vector<std::string> args, const std::string& needle) {
    const RunResult r = Run(args);
    EXPECT_EQ(r.exit_code, 1) << absl::StrJoin(args, " ") << "\nstderr: " << r.err;
    EXPECT_EQ(r.out, "") << absl::StrJoin(args, " ");
    EXPECT_NE(r.err.find(needle), std::string::npos)
        << absl::StrJoin(args, " ") << ": stderr does not mention \"" << needle << "\": " << r.err;
  }

  static std::string* dir_;
  static int64_t vocab_;
};

std::string* GenerateCliTest::dir_ = nullptr;
int64_t GenerateCliTest::vocab_ = 0;

TEST_F(GenerateCliTest, PrintsSixteenIdsIdenticalOnEveryRun) {
  const std::vector<std::string> args = {"--model",          Model(), "--prompt-ids", "1,2,3",
                                         "--max-new-tokens", "16"};
  const RunResult first = Run(args);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const std::vector<std::string> lines = Lines(first.out);
  ASSERT_EQ(lines.size(), 1u) << first.out;
  const std::vector<int64_t> ids = ParseIds(lines[0]);
  ASSERT_EQ(ids.size(), 16u) << lines[0];
  for (int64_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, vocab_);
  }
  // Not a constant: random weights of the tiny preset do not collapse to one token.
  EXPECT_NE(std::count(ids.begin(), ids.end(), ids[0]), 16);

  const RunResult second = Run(args);
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_EQ(second.out, first.out);
}

TEST_F(GenerateCliTest, NaiveMlaGivesTheSameIdsAsAbsorbed) {
  const RunResult absorbed = Run(
      {"--model", Model(), "--prompt-ids", "1,2,3", "--max-new-tokens", "16", "--mla", "absorbed"});
  const RunResult naive = Run(
      {"--model", Model(), "--prompt-ids", "1,2,3", "--max-new-tokens", "16", "--mla", "naive"});
  ASSERT_EQ(absorbed.exit_code, 0) << absorbed.err;
  ASSERT_EQ(naive.exit_code, 0) << naive.err;
  EXPECT_EQ(naive.out, absorbed.out);
  EXPECT_EQ(ParseIds(Lines(naive.out).at(0)).size(), 16u);
}

TEST_F(GenerateCliTest, DumpLogitsWritesEveryPromptPosition) {
  const std::string dump = File("dump.bin");
  const RunResult r = Run({"--model", Model(), "--prompt-ids", "0,5,9,300,77", "--max-new-tokens",
                           "2", "--dump-logits", dump, "--print-logits"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(std::filesystem::file_size(dump), 5u * vocab_ * sizeof(float));
  const std::vector<float> logits = ReadFloats(dump);
  ASSERT_EQ(logits.size(), static_cast<size_t>(5 * vocab_));
  for (float v : logits) ASSERT_TRUE(std::isfinite(v));

  // The last prompt row is what the first generated token was chosen from: it equals the first
  // --print-logits line (printed with %.9g, which round-trips float32) and its arg-max is that
  // token. Rows differ from each other (each position sees a different prefix).
  const std::vector<std::string> lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 3u) << r.out;
  const std::vector<int64_t> ids = ParseIds(lines[0]);
  ASSERT_EQ(ids.size(), 2u);
  const std::string prefix = "logits 0:";
  ASSERT_EQ(lines[1].rfind(prefix, 0), 0u) << lines[1];
  std::vector<std::string> printed =
      absl::StrSplit(lines[1].substr(prefix.size()), ' ', absl::SkipEmpty());
  ASSERT_EQ(printed.size(), static_cast<size_t>(vocab_));
  const float* last_row = logits.data() + 4 * vocab_;
  int64_t best = 0;
  for (int64_t v = 0; v < vocab_; ++v) {
    float value = 0;
    ASSERT_TRUE(absl::SimpleAtof(printed[v], &value)) << printed[v];
    ASSERT_EQ(value, last_row[v]) << "vocab entry " << v;
    if (last_row[v] > last_row[best]) best = v;
  }
  EXPECT_EQ(best, ids[0]);
  EXPECT_NE(std::vector<float>(logits.begin(), logits.begin() + vocab_),
            std::vector<float>(last_row, last_row + vocab_));

  // With no new tokens the dump is still written (prefill only) and stdout is an empty line.
  const std::string dump0 = File("dump0.bin");
  const RunResult r0 = Run({"--model", Model(), "--prompt-ids", "0,5,9,300,77", "--max-new-tokens",
                            "0", "--dump-logits", dump0});
  ASSERT_EQ(r0.exit_code, 0) << r0.err;
  EXPECT_EQ(r0.out, "\n");
  EXPECT_EQ(ReadFloats(dump0), logits);
}

TEST_F(GenerateCliTest, PromptTextIsEncodedWithTheCheckpointTokenizer) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Load(Model());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const std::string text = "Hello world, the quick brown fox.";
  const std::vector<int32_t> encoded = (*tokenizer)->Encode(text, (*tokenizer)->add_bos_token());
  ASSERT_TRUE((*tokenizer)->add_bos_token());
  ASSERT_EQ(encoded.front(), (*tokenizer)->bos_id());

  const RunResult by_text = Run({"--model", Model(), "--prompt", text, "--max-new-tokens", "8"});
  const RunResult by_ids = Run(
      {"--model", Model(), "--prompt-ids", absl::StrJoin(encoded, ","), "--max-new-tokens", "8"});
  ASSERT_EQ(by_text.exit_code, 0) << by_text.err;
  ASSERT_EQ(by_ids.exit_code, 0) << by_ids.err;
  const std::vector<std::string> text_lines = Lines(by_text.out);
  ASSERT_EQ(text_lines.size(), 2u) << by_text.out;
  EXPECT_EQ(Lines(by_ids.out).size(), 1u) << by_ids.out;  // --prompt-ids: ids only
  EXPECT_EQ(text_lines[0], Lines(by_ids.out).at(0));
  std::vector<int32_t> continuation;
  for (int64_t id : ParseIds(text_lines[0])) continuation.push_back(static_cast<int32_t>(id));
  ASSERT_EQ(continuation.size(), 8u);
  EXPECT_EQ(text_lines[1],
            absl::StrCat("text: ", absl::Utf8SafeCEscape((*tokenizer)->Decode(continuation))));
}

TEST_F(GenerateCliTest, BadInputExitsOneWithAMessage) {
  ExpectFailure({"--model", File("no-such-dir"), "--prompt-ids", "1,2,3"}, "no-such-dir");
  ExpectFailure({"--model", Model(), "--prompt-ids", absl::StrCat("1,", vocab_, ",3")},
                absl::StrCat("id ", vocab_));
  ExpectFailure({"--model", Model(), "--prompt-ids", "1,-4"}, "-4");
  ExpectFailure({"--model", Model(), "--prompt-ids", "1,x,3"}, "\"x\"");
  ExpectFailure({"--model", Model(), "--prompt-ids", "1,2", "--no-such-flag"}, "no_such_flag");
  ExpectFailure({"--model", Model(), "--prompt-ids", "1,2", "--mla", "fast"}, "--mla");
  ExpectFailure({"--model", Model()}, "--prompt-ids");
  ExpectFailure({"--model", Model(), "--prompt-ids", "1", "--prompt", "hi"}, "not both");
  ExpectFailure({"--prompt-ids", "1,2"}, "--model");
  ExpectFailure({"--model", Model(), "--prompt-ids", "1", "--max-new-tokens", "-1"},
                "--max-new-tokens");
  ExpectFailure({"--model", Model(), "--prompt-ids", "1", "--dump-logits", File("nodir/x.bin")},
                "nodir/x.bin");
  ExpectFailure({"--model", Model(), "--prompt-ids", "1", "stray"}, "stray");
}

}  // namespace
}  // namespace hmoe

// Every binary's --help lists its own flags (common/base/flags.h SetUsage): absl's default
// filter lists only the flags of a file named after the binary and printed "No flags matched."
// for all of ours.

#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "common/base/flags.h"
#include "tests/integration/child_process.h"
#include "tests/integration/temp_dir.h"

namespace hmoe {
namespace {

using ::hmoe::testing::ChildOptions;
using ::hmoe::testing::ChildProcess;

struct Binary {
  const char* path;
  const char* flag;  // one of its own flags, as --help spells it
};

TEST(HelpTest, EveryBinaryListsItsOwnFlags) {
  const std::vector<Binary> binaries = {
      {HMOE_WEIGHTD_PATH, "--hugepages"},
      {HMOE_PREFILL_WORKER_PATH, "--ring_slots"},
      {HMOE_DECODE_WORKER_PATH, "--prefill_packing"},
      {HMOE_ROUTER_PATH, "--chunk_threshold"},
      {HMOE_CLI_PATH, "--max_new_tokens"},
      {HMOE_MAKE_MODEL_PATH, "--preset"},
      {HMOE_GENERATE_PATH, "--prompt_ids"},
  };
  ::hmoe::testing::TempDir dir("hmoe_help_test");
  ASSERT_FALSE(dir.path().empty());
  int i = 0;
  for (const Binary& b : binaries) {
    ChildOptions o;
    o.argv = {b.path, "--help"};
    o.stdout_path = dir.File(absl::StrCat(i, ".out"));
    o.stderr_path = dir.File(absl::StrCat(i++, ".err"));
    auto child = ChildProcess::Start(std::move(o));
    ASSERT_TRUE(child.ok()) << child.status();
    ASSERT_TRUE(child->WaitForExit(std::chrono::seconds(30)).ok()) << b.path;
    const std::string help = child->ReadStdout() + child->ReadStderr();
    EXPECT_FALSE(absl::StrContains(help, "No flags matched")) << b.path << ":\n" << help;
    EXPECT_TRUE(absl::StrContains(help, b.flag)) << b.path << " lacks " << b.flag << ":\n" << help;
    // abseil's own flags stay under --helpfull.
    EXPECT_FALSE(absl::StrContains(help, "--flagfile")) << b.path << ":\n" << help;
  }
}

TEST(HelpTest, OwnFlagFilesAreAllButAbseils) {
  EXPECT_TRUE(IsOwnFlagFile("/work/main/decode_worker/main.cc"));
  EXPECT_TRUE(IsOwnFlagFile("tools/make_model.cc"));
  EXPECT_FALSE(IsOwnFlagFile("/build/abseil/absl/flags/parse.cc"));
  EXPECT_FALSE(IsOwnFlagFile("absl/flags/internal/usage.cc"));
}

}  // namespace
}  // namespace hmoe

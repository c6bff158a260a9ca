#include "common/base/flags.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace hmoe {
namespace {

std::vector<std::string> Normalize(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::vector<std::string> storage;
  std::vector<char*> out = NormalizeFlagNames(static_cast<int>(argv.size()), argv.data(), storage);
  return std::vector<std::string>(out.begin(), out.end());
}

TEST(NormalizeFlagNamesTest, DashedNamesBecomeUnderscoredAndValuesStay) {
  EXPECT_EQ(Normalize({"hmoe-x", "--batch-size=6", "--chunk-size", "a-b", "--x", "-v",
                       "--model=/tmp/a-b", "positional-arg"}),
            (std::vector<std::string>{"hmoe-x", "--batch_size=6", "--chunk_size", "a-b", "--x",
                                      "-v", "--model=/tmp/a-b", "positional-arg"}));
}

TEST(NormalizeFlagNamesTest, NothingAfterADoubleDashChanges) {
  EXPECT_EQ(Normalize({"hmoe-x", "--dual-batch=on", "--", "--not-a-flag", "--"}),
            (std::vector<std::string>{"hmoe-x", "--dual_batch=on", "--", "--not-a-flag", "--"}));
}

TEST(NormalizeFlagNamesTest, ProgramNameAndShortArgumentsAreUntouched) {
  EXPECT_EQ(Normalize({"--odd-program-name", "--", "-"}),
            (std::vector<std::string>{"--odd-program-name", "--", "-"}));
  EXPECT_EQ(Normalize({"p", "--a-b=--c-d"}), (std::vector<std::string>{"p", "--a_b=--c-d"}));
}

}  // namespace
}  // namespace hmoe

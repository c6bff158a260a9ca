#pragma once

// A fresh owner-only directory for one test or suite, removed with its contents when the object
// is destroyed. Header-only so every test target can use it without a library.
//
//   hmoe::testing::TempDir dir("hmoe_router");   // $TEST_TMPDIR (or /tmp)/hmoe_router.XXXXXX
//   ASSERT_FALSE(dir.path().empty());
//   const std::string socket = dir.File("registry.sock");
//
// A directory that outlives its tests (a cache of fixtures in a function-local static, a pid-named
// directory nobody removes) is a leak that grows with every run: ctest runs every case as its own
// process. Keep fixtures in a TempDir that something destroys (TearDownAfterLastTest below).

#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <system_error>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

namespace hmoe::testing {

class TempDir {
 public:
  // `prefix` names the directory (prefix.XXXXXX) under ::testing::TempDir(), which honours
  // TEST_TMPDIR. On failure the test fails and path() is empty.
  explicit TempDir(std::string_view prefix = "hmoe_test") {
    std::string tmpl = absl::StrCat(::testing::TempDir(), std::string(prefix), ".XXXXXX");
    if (::mkdtemp(tmpl.data()) != nullptr) {  // mode 0700
      path_ = std::move(tmpl);
    } else {
      ADD_FAILURE() << "mkdtemp " << tmpl << " failed";
    }
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(std::string_view name) const {
    return absl::StrCat(path_, "/", std::string(name));
  }

 private:
  std::string path_;
};

// Runs a function after the last test of the binary: a gtest global environment, registered
// at namespace scope before main (gtest.h documents the idiom):
//   [[maybe_unused]] ::testing::Environment* const kCleanup = ::testing::AddGlobalTestEnvironment(
//       new hmoe::testing::TearDownAfterLastTest([] { Models().clear(); }));
// For fixtures that the cases of a binary share through a function-local static cache (a
// checkpoint written into a ScopedTempDir, worker processes): ctest runs every case as its own
// process, so a cache left for the OS to reclaim leaks its temp dir — 400 MB for `small` — on
// every case of every run.
class TearDownAfterLastTest : public ::testing::Environment {
 public:
  explicit TearDownAfterLastTest(std::function<void()> tear_down)
      : tear_down_(std::move(tear_down)) {}
  void TearDown() override { tear_down_(); }

 private:
  std::function<void()> tear_down_;
};

}  // namespace hmoe::testing

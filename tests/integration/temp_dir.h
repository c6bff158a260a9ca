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
// process. Keep fixtures in a TempDir that something destroys (see
// tests/decode_worker/decode_test_util.h TearDownAfterLastTest).

#include <stdlib.h>

#include <filesystem>
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

}  // namespace hmoe::testing

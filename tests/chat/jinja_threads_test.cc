// Concurrent renders of one Template (label threads: scripts/test.sh runs it under TSan).
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/chat/jinja.h"

namespace hmoe::jinja {
namespace {

using json = nlohmann::ordered_json;

TEST(JinjaRender, ConcurrentRendersOfOneTemplateAgree) {
  auto t = Template::Parse(
      "{% set ns = namespace(n=0) %}{% macro m(x) %}[{{ x }}]{% endmacro %}"
      "{% for i in range(50) %}{% set ns.n = ns.n + i %}{{ m(i) }}{% endfor %}{{ ns.n }}");
  ASSERT_TRUE(t.ok()) << t.status();
  const std::string want = *t->Render(json::object());
  std::vector<std::string> got(4);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int r = 0; r < 50; ++r) {
        auto out = t->Render(json::object());
        got[k] = out.ok() ? *out : out.status().ToString();
        if (got[k] != want) return;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& g : got) EXPECT_EQ(g, want);
  EXPECT_THAT(want, ::testing::EndsWith("[49]1225"));
}

}  // namespace
}  // namespace hmoe::jinja

// Tests of ChatTemplate: loading a checkpoint's chat template in its documented forms and
// rendering a request with the variables transformers passes.
#include "common/chat/chat_template.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace hmoe::chat {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::ordered_json;

class ChatTemplateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        std::filesystem::temp_directory_path() /
        (std::string("hmoe_chat_template_test_") + info->name() + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  void WriteConfig(const json& config) { Write("tokenizer_config.json", config.dump()); }

  std::filesystem::path dir_;
};

constexpr char kSimple[] =
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}";

ChatRequest Hello() {
  ChatRequest r;
  r.messages = json::array({{{"role", "user"}, {"content", "hi"}}});
  return r;
}

TEST_F(ChatTemplateTest, StringFormWithAddedTokenObjects) {
  WriteConfig({{"bos_token", {{"__type", "AddedToken"}, {"content", "<s>"}}},
               {"eos_token", "</s>"},
               {"chat_template", kSimple}});
  auto t = ChatTemplate::FromCheckpoint(dir_.string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->bos_token(), "<s>");
  EXPECT_EQ(t->eos_token(), "</s>");
  auto r = t->Render(Hello());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "<s><user>hi<assistant>");
  // The config file itself works as the path too.
  auto again = ChatTemplate::FromCheckpoint((dir_ / "tokenizer_config.json").string());
  ASSERT_TRUE(again.ok()) << again.status();
  ChatRequest no_prompt = Hello();
  no_prompt.add_generation_prompt = false;
  EXPECT_EQ(*again->Render(no_prompt), "<s><user>hi");
}

TEST_F(ChatTemplateTest, ListFormPicksToolUseWhenToolsAreGiven) {
  WriteConfig({{"chat_template",
                {{{"name", "default"}, {"template", "default:{{ tools }}"}},
                 {{"name", "tool_use"}, {"template", "tools:{{ tools | length }}"}}}}});
  auto t = ChatTemplate::FromCheckpoint(dir_.string());
  ASSERT_TRUE(t.ok()) << t.status();
  ChatRequest r = Hello();
  EXPECT_EQ(*t->Render(r), "default:None");
  r.tools = json::array({{{"type", "function"}}});
  EXPECT_EQ(*t->Render(r), "tools:1");
}

TEST_F(ChatTemplateTest, ListFormNeedsADefault) {
  WriteConfig({{"chat_template", {{{"name", "rag"}, {"template", "x"}}}}});
  auto t = ChatTemplate::FromCheckpoint(dir_.string());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("none is 'default'"));
}

TEST_F(ChatTemplateTest, ChatTemplateJinjaFileWins) {
  WriteConfig({{"bos_token", "[B]"}, {"chat_template", "from config"}});
  Write("chat_template.jinja", "from file {{ bos_token }}\n");
  auto t = ChatTemplate::FromCheckpoint(dir_.string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t->Render(Hello()), "from file [B]");
}

TEST_F(ChatTemplateTest, ExtraVariablesReachTheTemplate) {
  auto t = ChatTemplate::FromString(
      "{{ 'T' if thinking else 'F' }}{{ enable_thinking is defined }}{{ eos_token is defined }}",
      "<s>", std::nullopt);
  ASSERT_TRUE(t.ok()) << t.status();
  ChatRequest r = Hello();
  EXPECT_EQ(*t->Render(r), "FFalseFalse");
  r.extra = {{"thinking", true}, {"enable_thinking", false}};
  EXPECT_EQ(*t->Render(r), "TTrueFalse");
}

TEST_F(ChatTemplateTest, ErrorsNameTheFileAndLine) {
  WriteConfig({{"chat_template", "ok\n{% call x() %}{% endcall %}"}});
  auto t = ChatTemplate::FromCheckpoint(dir_.string());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("tokenizer_config.json"));
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("line 2: unsupported statement"));

  Write("bad.jinja", "{{ x | shuffle }}");
  auto f = ChatTemplate::FromFile((dir_ / "bad.jinja").string(), std::nullopt, std::nullopt);
  EXPECT_THAT(std::string(f.status().message()), HasSubstr("bad.jinja"));
  EXPECT_THAT(std::string(f.status().message()), HasSubstr("unsupported filter 'shuffle'"));

  EXPECT_EQ(ChatTemplate::FromFile((dir_ / "none.jinja").string(), std::nullopt, std::nullopt)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ChatTemplateTest, MissingOrMalformedConfig) {
  EXPECT_EQ(ChatTemplate::FromCheckpoint(dir_.string()).status().code(),
            absl::StatusCode::kNotFound);
  WriteConfig({{"bos_token", "<s>"}});
  EXPECT_EQ(ChatTemplate::FromCheckpoint(dir_.string()).status().code(),
            absl::StatusCode::kNotFound);
  Write("tokenizer_config.json", "{not json");
  EXPECT_EQ(ChatTemplate::FromCheckpoint(dir_.string()).status().code(),
            absl::StatusCode::kInvalidArgument);
  WriteConfig({{"chat_template", 5}});
  EXPECT_EQ(ChatTemplate::FromCheckpoint(dir_.string()).status().code(),
            absl::StatusCode::kInvalidArgument);
  WriteConfig({{"bos_token", 5}, {"chat_template", "x"}});
  EXPECT_EQ(ChatTemplate::FromCheckpoint(dir_.string()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ChatTemplateTest, BadRequestsAndRaisedErrors) {
  auto t = ChatTemplate::FromString(
      "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
      "{{ raise_exception('Unknown role: ' ~ m.role) }}{% endif %}{% endfor %}ok",
      std::nullopt, std::nullopt);
  ASSERT_TRUE(t.ok()) << t.status();
  ChatRequest r = Hello();
  r.messages.push_back({{"role", "narrator"}, {"content", "x"}});
  auto out = t->Render(r);
  EXPECT_EQ(out.status().message(), "Unknown role: narrator");
  EXPECT_TRUE(jinja::IsRaisedByTemplate(out.status()));
  r.messages = json::object();
  EXPECT_EQ(t->Render(r).status().code(), absl::StatusCode::kInvalidArgument);
  r = Hello();
  r.tools = "x";
  EXPECT_EQ(t->Render(r).status().code(), absl::StatusCode::kInvalidArgument);
}

// The shipped test templates load, and each renders a conversation with every turn kind.
TEST_F(ChatTemplateTest, ShippedTestTemplatesRender) {
  const std::filesystem::path data =
      std::filesystem::path(HMOE_SOURCE_DIR) / "tests/data/chat_templates";
  ChatRequest r;
  r.messages = json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "functions.get_weather:0",
      "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C"},
    {"role": "assistant", "content": "<think>ok</think>It is 18C."},
    {"role": "user", "content": "Thanks"}])");
  for (const char* name : {"deepseek_v3", "deepseek_r1", "deepseek_v31", "kimi_k2"}) {
    auto t =
        ChatTemplate::FromFile((data / (std::string(name) + ".jinja")).string(), "<bos>", "<eos>");
    ASSERT_TRUE(t.ok()) << name << ": " << t.status();
    auto out = t->Render(r);
    ASSERT_TRUE(out.ok()) << name << ": " << out.status();
    EXPECT_THAT(*out, HasSubstr("Thanks")) << name;
    EXPECT_THAT(*out, HasSubstr("18C")) << name;
  }
}

}  // namespace
}  // namespace hmoe::chat

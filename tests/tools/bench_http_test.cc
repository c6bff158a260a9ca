// `hmoe bench --protocol http`'s pure parts (tools/bench/http_client.h, bench_runner.h): the
// server-sent-events parser on hand-made byte strings (events split anywhere across reads, CRLF
// lines, comments, multi-line data, [DONE], a cut stream), the /v1/completions events folded into
// a request record (text events, usage, finish reason, error events), the request body, and the
// per-token metrics of a record whose events carry several tokens, and the client's deadline
// against a server that stops talking. Times are small binary
// fractions, so the metrics are exact up to a few ulps; 1e-12 bounds that.

#include <cmath>
#include <future>
#include <string>
#include <thread>
#include <utility>  // before Boost.Asio: its awaitable.hpp uses std::exchange without it
#include <vector>

#include <boost/asio.hpp>

#include "tools/bench/bench_runner.h"
#include "tools/bench/bench_stats.h"
#include "tools/bench/http_client.h"

#include "gtest/gtest.h"
#include <nlohmann/json.hpp>

namespace hmoe::bench {
namespace {

constexpr double kTol = 1e-12;

std::vector<std::string> FeedAll(SseParser& p, const std::vector<std::string>& reads) {
  std::vector<std::string> out;
  for (const std::string& r : reads) {
    p.Feed(r, [&](absl::string_view d) { out.emplace_back(d); });
  }
  return out;
}

TEST(SseParserTest, WholeEvents) {
  SseParser p;
  EXPECT_EQ(FeedAll(p, {"data: {\"a\":1}\n\ndata: [DONE]\n\n"}),
            (std::vector<std::string>{"{\"a\":1}", "[DONE]"}));
  EXPECT_EQ(p.pending(), 0u);
}

TEST(SseParserTest, EventsSplitAtEveryByte) {
  const std::string stream = "data: {\"x\":\"a b\"}\n\ndata: second\n\ndata: [DONE]\n\n";
  // Every split point, and one byte per read.
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    SseParser p;
    EXPECT_EQ(FeedAll(p, {stream.substr(0, cut), stream.substr(cut)}),
              (std::vector<std::string>{"{\"x\":\"a b\"}", "second", "[DONE]"}))
        << cut;
    EXPECT_EQ(p.pending(), 0u);
  }
  SseParser p;
  std::vector<std::string> bytes;
  for (char c : stream) bytes.emplace_back(1, c);
  EXPECT_EQ(FeedAll(p, bytes), (std::vector<std::string>{"{\"x\":\"a b\"}", "second", "[DONE]"}));
}

TEST(SseParserTest, CrlfCommentsOtherFieldsAndMultiLineData) {
  SseParser p;
  EXPECT_EQ(FeedAll(p, {": keep-alive\r\n\r\nevent: x\r\nid: 3\r\ndata: one\r\ndata:two\r\n\r\n",
                        "data\n\n"}),
            (std::vector<std::string>{"one\ntwo", ""}));
}

TEST(SseParserTest, ACutStreamLeavesPendingBytes) {
  SseParser p;
  EXPECT_EQ(FeedAll(p, {"data: {\"a\":1}\n\ndata: {\"b\""}),
            (std::vector<std::string>{"{\"a\":1}"}));
  EXPECT_GT(p.pending(), 0u);
  SseParser q;
  EXPECT_TRUE(FeedAll(q, {"data: x\n"}).empty());  // the line ended, the event did not
  EXPECT_GT(q.pending(), 0u);
}

TEST(CompletionEventsTest, TextEventsUsageFinishAndDone) {
  RequestResult r;
  CompletionEvents e;
  ApplyCompletionEvent(
      R"({"choices":[{"index":0,"text":"Hel","finish_reason":null}],"usage":null})", 0.5, r, e);
  // An event with empty text is not a token arrival.
  ApplyCompletionEvent(R"({"choices":[{"index":0,"text":"","finish_reason":null}]})", 0.625, r, e);
  ApplyCompletionEvent(R"({"choices":[{"index":0,"text":"lo","finish_reason":null}]})", 0.75, r, e);
  ApplyCompletionEvent(R"({"choices":[{"index":0,"text":"","finish_reason":"length"}]})", 1.0, r,
                       e);
  EXPECT_FALSE(e.usage);
  ApplyCompletionEvent(
      R"({"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":5,"total_tokens":14,)"
      R"("prompt_tokens_details":{"cached_tokens":4}}})",
      1.0, r, e);
  EXPECT_FALSE(e.done);
  ApplyCompletionEvent("[DONE]", 1.0, r, e);
  EXPECT_TRUE(e.done);
  EXPECT_TRUE(e.usage);
  EXPECT_TRUE(e.error_type.empty());
  EXPECT_EQ(r.token_s, (std::vector<double>{0.5, 0.75}));
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_EQ(r.counted_tokens, 5);
  EXPECT_EQ(r.cached_prompt_tokens, 4);
}

TEST(CompletionEventsTest, ErrorEventsAndGarbage) {
  RequestResult r;
  CompletionEvents e;
  ApplyCompletionEvent(
      R"({"error":{"message":"decode worker lost","type":"service_unavailable_error",)"
      R"("param":null,"code":null}})",
      0.25, r, e);
  EXPECT_EQ(e.error_type, "service_unavailable_error");
  EXPECT_EQ(e.error_message, "decode worker lost");
  RequestResult g;
  CompletionEvents f;
  ApplyCompletionEvent("not json", 0.25, g, f);
  EXPECT_EQ(f.error_type, "bad_event");
  EXPECT_NE(f.error_message.find("not json"), std::string::npos);
  EXPECT_TRUE(g.token_s.empty());
}

// No event had text: the finish event is the first (and only) arrival.
TEST(CompletionEventsTest, NoTextTheFinishEventArrives) {
  RequestResult r;
  CompletionEvents e;
  ApplyCompletionEvent(R"({"choices":[{"index":0,"text":"","finish_reason":"length"}]})", 0.75, r,
                       e);
  EXPECT_EQ(r.token_s, (std::vector<double>{0.75}));
  EXPECT_EQ(r.finish_reason, "length");
}

TEST(CompletionEventsTest, RequestBody) {
  PlannedRequest q;
  q.prompt = {5, 6, 7};
  q.max_new_tokens = 12;
  const nlohmann::json j = nlohmann::json::parse(CompletionRequestBody(q));
  EXPECT_EQ(j["prompt"], nlohmann::json::array({5, 6, 7}));
  EXPECT_EQ(j["max_tokens"], 12);
  EXPECT_EQ(j["temperature"], 0);
  EXPECT_EQ(j["ignore_eos"], true);
  EXPECT_EQ(j["cache_prompt"], true);
  EXPECT_EQ(j["stream"], true);
  EXPECT_EQ(j["stream_options"]["include_usage"], true);
  q.cache_prompt = false;  // calibration's requests
  EXPECT_EQ(nlohmann::json::parse(CompletionRequestBody(q))["cache_prompt"], false);
}

// Three events carrying 7 tokens: TPOT divides by the tokens, ITL stays per event.
TEST(CountedTokensTest, TpotPerTokenGapsPerEvent) {
  RequestRecord r;
  r.ok = true;
  r.start_s = 1;
  r.token_s = {1.5, 2.0, 3.5};
  r.end_s = 3.75;
  r.counted_tokens = 7;
  EXPECT_EQ(OutputTokens(r), 7);
  EXPECT_NEAR(Ttft(r), 0.5, kTol);
  EXPECT_NEAR(Tpot(r), 2.0 / 6, kTol);
  EXPECT_EQ(InterTokenGaps(r), (std::vector<double>{0.5, 1.5}));
  const Summary s = Summarize(std::vector<RequestRecord>{r}, Slo{1.0, 0.5});
  EXPECT_EQ(s.output_tokens, 7);
  EXPECT_EQ(s.slo_met, 1);
  EXPECT_EQ(s.tpot.count, 1);
  EXPECT_EQ(s.itl.count, 2);
  // All text in one event: no TPOT (not 0), and the TPOT part of the SLO does not apply.
  r.token_s = {1.5};
  EXPECT_TRUE(std::isnan(Tpot(r)));
  EXPECT_TRUE(MeetsSlo(r, Slo{1.0, 0.001}));
  // Without a count, one token per entry as before.
  r.token_s = {1.5, 2.0, 3.5};
  r.counted_tokens = -1;
  EXPECT_EQ(OutputTokens(r), 3);
  EXPECT_NEAR(Tpot(r), 1.0, kTol);
}

// A server that answers 200 with one event and then says nothing more, keeping the connection
// open: a blocking client would wait forever. The deadline ends the exchange, keeps what was read
// and says why.
TEST(HttpClientTest, TheDeadlineEndsAStreamThatStopsTalking) {
  namespace asio = boost::asio;
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  const int port = acceptor.local_endpoint().port();
  std::promise<void> done;
  std::thread server([&] {
    asio::ip::tcp::socket s(io);
    acceptor.accept(s);
    asio::streambuf request;
    asio::read_until(s, request, "\r\n\r\n");
    asio::write(s, asio::buffer(std::string("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                            "Transfer-Encoding: chunked\r\n\r\n"
                                            "f\r\ndata: {\"a\":1}\n\n\r\n")));
    done.get_future().wait();  // silent until the client gave up
  });
  HttpClient client;
  ASSERT_TRUE(client.Connect("127.0.0.1:" + std::to_string(port)).ok());
  std::vector<std::string> events;
  const HttpResponse r = client.Post(
      "/v1/completions", "{}", [&](absl::string_view d) { events.emplace_back(d); }, {},
      absl::Milliseconds(300));
  done.set_value();
  server.join();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(events, (std::vector<std::string>{"{\"a\":1}"}));
  EXPECT_NE(r.transport_error.find("client deadline"), std::string::npos) << r.transport_error;
  EXPECT_FALSE(r.keep_alive);
}

}  // namespace
}  // namespace hmoe::bench

// common/http/server.h in-process: responses complete and streamed, keep-alive and pipelining,
// the server's own protocol errors, disconnect detection while a response is pending (and the
// on_client_gone call), the bound on a client that does not read, and a responder that outlives
// Stop().

#include "common/http/server.h"

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

#include "tests/router/http_client.h"

#include "gtest/gtest.h"

namespace hmoe::http {
namespace {

using ::hmoe::testing::HttpConnection;
using ::hmoe::testing::HttpResponse;

class ServerTest : public ::testing::Test {
 protected:
  void Start(ServerOptions options = {}) {
    // Once per connection that goes away mid-response; a test may see several.
    options.on_client_gone = [this] {
      if (clients_gone_.fetch_add(1) == 0) client_gone_.Notify();
    };
    absl::StatusOr<std::unique_ptr<Server>> s = Server::Start(
        "127.0.0.1:0", std::move(options),
        [this](Request request, std::shared_ptr<Responder> responder) {
          if (request.path == "/stream") {
            responder->StartStream(200, "text/event-stream");
            for (int i = 0; i < 3; ++i) responder->Write(absl::StrCat("data: ", i, "\n\n"));
            responder->End();
          } else if (request.path == "/hold") {
            // Answered later by the test.
            absl::MutexLock lock(&mu_);
            held_ = std::move(responder);
            held_ready_.Notify();
          } else {
            responder->Send(200, "text/plain",
                            absl::StrCat(request.method, " ", request.target, " ", request.body));
          }
        });
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }

  std::shared_ptr<Responder> Held() {
    held_ready_.WaitForNotification();
    absl::MutexLock lock(&mu_);
    return held_;
  }

  std::unique_ptr<Server> server_;
  absl::Mutex mu_;
  std::shared_ptr<Responder> held_ ABSL_GUARDED_BY(mu_);
  absl::Notification held_ready_;
  absl::Notification client_gone_;  // ServerOptions::on_client_gone was called
  std::atomic<int> clients_gone_{0};
};

TEST_F(ServerTest, CompleteAndStreamedResponsesKeepAliveAndPipelining) {
  Start();
  HttpConnection c(server_->port());
  ASSERT_TRUE(c.SendRequest("POST", "/echo?x=1", "hello"));
  HttpResponse r = c.ReadResponse();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "POST /echo?x=1 hello");
  ASSERT_TRUE(c.SendRequest("GET", "/stream", ""));
  r = c.ReadResponse();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.Header("transfer-encoding"), "chunked");
  EXPECT_EQ(r.body, "data: 0\n\ndata: 1\n\ndata: 2\n\n");
  // Two requests in one write: answered in order.
  ASSERT_TRUE(c.Send("GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_EQ(c.ReadResponse().body, "GET /a ");
  EXPECT_EQ(c.ReadResponse().body, "GET /b ");
}

TEST_F(ServerTest, ExpectContinueGetsOneHundredContinueBeforeTheBody) {
  Start();
  HttpConnection c(server_->port());
  ASSERT_TRUE(
      c.Send("POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
             "Content-Length: 5\r\n\r\n"));
  HttpResponse interim;
  ASSERT_TRUE(c.ReadHead(&interim));
  EXPECT_EQ(interim.status, 100);
  ASSERT_TRUE(c.Send("hello"));
  HttpResponse r = c.ReadResponse();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "POST /e hello");
}

TEST_F(ServerTest, ProtocolErrorsAreAnsweredAndClosed) {
  ServerOptions o;
  o.max_body_bytes = 100;
  o.read_timeout = absl::Milliseconds(300);
  o.error_body = [](int status, absl::string_view message) {
    return absl::StrCat(status, ": ", message);
  };
  Start(o);
  {
    HttpConnection c(server_->port());
    c.SendRequest("POST", "/x", std::string(101, 'a'));
    HttpResponse r = c.ReadResponse();
    EXPECT_EQ(r.status, 413);
    EXPECT_TRUE(absl::StrContains(r.body, "over the limit of 100 bytes")) << r.body;
    EXPECT_TRUE(c.WaitClosed());
  }
  {
    HttpConnection c(server_->port());
    c.Send("GARBAGE\r\n\r\n");
    EXPECT_EQ(c.ReadResponse().status, 400);
  }
  {
    HttpConnection c(server_->port());
    c.SendRequest("GET", "/x", "", "HTTP/1.0");
    EXPECT_EQ(c.ReadResponse().status, 505);
  }
  {
    HttpConnection c(server_->port());
    c.Send("GET /x HTTP/1.1\r\nHo");
    EXPECT_EQ(c.ReadResponse().status, 408);
    EXPECT_TRUE(c.WaitClosed());
  }
  {
    // Idle keep-alive connection: closed without an answer.
    HttpConnection c(server_->port());
    EXPECT_TRUE(c.WaitClosed());
  }
}

TEST_F(ServerTest, ClientClosingDuringAResponseIsSeen) {
  Start();
  auto c = std::make_unique<HttpConnection>(server_->port());
  ASSERT_TRUE(c->SendRequest("GET", "/hold", ""));
  std::shared_ptr<Responder> r = Held();
  EXPECT_FALSE(r->ClientGone());
  r->StartStream(200, "text/event-stream");
  EXPECT_TRUE(r->Write("data: 1\n\n"));
  c.reset();  // the client goes away
  // Seen at once by the server's watch, which calls on_client_gone.
  ASSERT_TRUE(client_gone_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(r->ClientGone());
  EXPECT_FALSE(r->Write("data: 2\n\n"));
  r->End();
  // The server serves on.
  HttpConnection d(server_->port());
  ASSERT_TRUE(d.SendRequest("GET", "/x", ""));
  EXPECT_EQ(d.ReadResponse().status, 200);
}

TEST_F(ServerTest, AClientThatDoesNotReadIsCutOffAtTheQueueBound) {
  ServerOptions o;
  o.max_queued_bytes = 64 << 10;
  Start(o);
  // A 4 KiB receive window, never read.
  HttpConnection stuck(server_->port(), 60, 4096);
  ASSERT_TRUE(stuck.SendRequest("GET", "/hold", ""));
  std::shared_ptr<Responder> r = Held();
  r->StartStream(200, "text/event-stream");
  const std::string event = "data: " + std::string(1024, 'x') + "\n\n";
  // Writes never block; they fail once the kernel's buffers and 64 KiB of queue are full (the
  // kernel takes at most a few MiB on loopback: 100,000 events are far beyond).
  int written = 0;
  while (written < 100000 && r->Write(event)) ++written;
  EXPECT_LT(written, 100000);
  EXPECT_GT(written, 64);  // the queue's bound at least, not an early failure
  EXPECT_TRUE(r->ClientGone());
  ASSERT_TRUE(client_gone_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  r->End();
  // Another client is served meanwhile and after.
  HttpConnection d(server_->port());
  ASSERT_TRUE(d.SendRequest("GET", "/x", ""));
  EXPECT_EQ(d.ReadResponse().status, 200);
  // The stuck client gets what the kernel held, then the end of the connection, never the last
  // chunk.
  HttpResponse head;
  ASSERT_TRUE(stuck.ReadHead(&head));
  EXPECT_EQ(head.status, 200);
  bool end = false;
  int64_t bytes = 0;
  std::string last;
  while (!end) {
    last = stuck.ReadChunk(&end);
    bytes += static_cast<int64_t>(last.size());
  }
  EXPECT_LT(bytes, static_cast<int64_t>(written) * static_cast<int64_t>(event.size()));
}

TEST_F(ServerTest, ResponderOutlivingStopDropsItsWrites) {
  Start();
  HttpConnection c(server_->port());
  ASSERT_TRUE(c.SendRequest("GET", "/hold", ""));
  std::shared_ptr<Responder> r = Held();
  server_->StopAccepting();
  EXPECT_TRUE(r->ClientGone());
  server_->Stop();
  EXPECT_FALSE(r->Write("late"));
  r->End();
  server_.reset();
  r.reset();
}

TEST_F(ServerTest, BadAddressesAndAPortInUse) {
  Start();
  EXPECT_FALSE(Server::Start("nonsense", {}, nullptr).ok());
  EXPECT_FALSE(Server::Start("127.0.0.1:99999", {}, nullptr).ok());
  absl::StatusOr<std::unique_ptr<Server>> second =
      Server::Start(absl::StrCat("127.0.0.1:", server_->port()), {}, nullptr);
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
}

}  // namespace
}  // namespace hmoe::http

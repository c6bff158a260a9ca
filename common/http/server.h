#pragma once

// A small HTTP/1.1 server on Boost.Beast/Asio (docs/api.md "HTTP"): Beast parses the requests,
// responses are written as raw HTTP/1.1 (a complete body with Content-Length, or a chunked stream
// for server-sent events). Reading and queued writes run on a few I/O threads; a Responder call
// hands its bytes to the kernel from the caller's thread when nothing is queued before them (a
// non-blocking send: no thread hop per streamed token), and queues what the kernel does not take.
// Each connection has its own write queue, so a slow reader only ever delays itself, and the
// queue is bounded
// (ServerOptions::max_queued_bytes): a client that stops reading while its response keeps coming
// has its connection closed once that many bytes wait unsent, which sets ClientGone() (so the work
// behind it is cancelled) and logs a line naming the client. Handlers are called on an I/O thread
// and must not block: a long request (a generation) answers from a thread of its own through the
// Responder, which is thread-safe.
//
// Protocol errors never reach the handler; the server answers them itself with
// ServerOptions::error_body and closes the connection: a malformed request (400), a body over
// max_body_bytes (413), headers over max_header_bytes (431), an HTTP version other than 1.1
// (505), and a request not complete within read_timeout (408; also how a connection idle that long
// between requests ends). Beyond max_connections a new connection gets 503 and is closed.
//
// While a response is in progress the server watches the connection: a client that closes it
// (EOF or reset) sets Responder::ClientGone() at once and calls ServerOptions::on_client_gone, so
// the work behind the response can be cancelled without polling.

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace hmoe::http {

struct Request {
  std::string method;  // "GET", "POST", ...
  std::string target;  // as sent, with the query
  std::string path;    // target without the query
  std::string body;
  // Header fields, names lower-case, in arrival order.
  std::vector<std::pair<std::string, std::string>> headers;
};

// The answer to one request. Exactly one of Send, or StartStream + Write* + End. Thread-safe; it
// may outlive the connection (then everything is dropped) but not the Server.
class Responder {
 public:
  virtual ~Responder() = default;
  // A complete response (Content-Length).
  virtual void Send(int status, absl::string_view content_type, std::string body) = 0;
  // Starts a chunked response; each Write is one chunk (empty data is skipped).
  virtual void StartStream(int status, absl::string_view content_type) = 0;
  // False once the client is gone.
  virtual bool Write(std::string data) = 0;
  virtual void End() = 0;
  // The client closed the connection, it failed, or the server stops.
  virtual bool ClientGone() const = 0;
};

using Handler = std::function<void(Request request, std::shared_ptr<Responder> responder)>;

struct ServerOptions {
  size_t max_body_bytes = 4 << 20;
  size_t max_header_bytes = 64 << 10;
  // A request (headers and body) must arrive within this; also the keep-alive idle limit.
  absl::Duration read_timeout = absl::Seconds(30);
  int max_connections = 1024;
  int io_threads = 2;
  // Bytes of one connection's response that may wait unsent (beyond what the kernel's socket
  // buffer holds); past it the connection is closed and its responder ClientGone().
  size_t max_queued_bytes = 1 << 20;
  // Called on an I/O thread, at once, when a client goes away while its response is in progress
  // (closed, reset, a failed write, max_queued_bytes): the work behind it can stop now instead of
  // at its next look at ClientGone(). Must not block.
  std::function<void()> on_client_gone;
  // The body of the server's own error answers (status, message) and its content type.
  std::function<std::string(int status, absl::string_view message)> error_body =
      [](int, absl::string_view message) { return std::string(message) + "\n"; };
  std::string error_content_type = "text/plain; charset=utf-8";
};

class Server {
 public:
  // Binds `host_port` ("127.0.0.1:8000", "[::1]:0"; port 0 picks one) exclusively and starts
  // serving. Unavailable when the address is in use, InvalidArgument when it is malformed.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const std::string& host_port,
                                                       ServerOptions options, Handler handler);
  ~Server();  // Stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const;
  // Stops accepting and marks every connection's responder ClientGone (work behind responses can
  // then end). Idempotent.
  void StopAccepting();
  // StopAccepting, closes every connection and joins the I/O threads. Responders still held
  // afterwards drop what they are given. Idempotent.
  void Stop();

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// "HTTP/1.1 200 OK"-style reason phrase of a status code ("Unknown" for others).
absl::string_view ReasonPhrase(int status);

}  // namespace hmoe::http

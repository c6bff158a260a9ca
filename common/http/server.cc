#include "common/http/server.h"

#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <deque>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "common/base/logging.h"

namespace hmoe::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

absl::string_view ReasonPhrase(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 409:
      return "Conflict";
    case 413:
      return "Payload Too Large";
    case 415:
      return "Unsupported Media Type";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 499:
      return "Client Closed Request";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Unknown";
  }
}

namespace {

std::string Head(int status, absl::string_view content_type, absl::string_view framing,
                 bool keep_alive) {
  return absl::StrCat("HTTP/1.1 ", status, " ", ReasonPhrase(status),
                      "\r\nContent-Type: ", content_type, "\r\n", framing,
                      keep_alive ? "" : "Connection: close\r\n", "\r\n");
}

}  // namespace

// State shared by the server and every connection: whether the server stopped (then responders
// drop what they get instead of posting to the I/O threads).
struct Shared {
  absl::Mutex mu;
  bool stopped ABSL_GUARDED_BY(mu) = false;
  // Open connections (a connection kept by a responder may end after the server).
  std::atomic<int> open_connections{0};
};

class Connection;

struct Server::Impl {
  ServerOptions options;
  Handler handler;
  // Shared with the connections: a connection kept by a responder after Stop still destroys its
  // (closed) socket against a live io_context.
  std::shared_ptr<asio::io_context> io = std::make_shared<asio::io_context>();
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  // On a strand of its own: accept completions and StopAccepting's close never run concurrently.
  tcp::acceptor acceptor{asio::make_strand(*io)};
  std::shared_ptr<Shared> shared = std::make_shared<Shared>();
  std::vector<std::thread> threads;
  absl::Mutex mu;
  std::vector<std::weak_ptr<Connection>> connections ABSL_GUARDED_BY(mu);
  int port = 0;
  bool accepting_stopped = false;
  bool stopped = false;

  void Accept();
};

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Server::Impl* server, tcp::socket socket)
      : io_(server->io),
        shared_(server->shared),
        server_(server),
        strand_(socket.get_executor()),
        socket_(std::move(socket)),
        timer_(strand_) {
    ++shared_->open_connections;
    beast::error_code ec;
    const tcp::endpoint remote = socket_.remote_endpoint(ec);
    if (!ec) peer_ = absl::StrCat(remote.address().to_string(), ":", remote.port());
  }
  ~Connection() { --shared_->open_connections; }

  void Start() {
    asio::dispatch(strand_, [self = shared_from_this()] { self->ReadRequest(); });
  }

  // From any thread: ends the connection (server stop).
  void Close() {
    gone_.store(true);
    asio::post(strand_, [self = shared_from_this()] { self->CloseNow(); });
  }

  bool gone() const { return gone_.load(); }

  // Any thread: bytes of response `generation`; `last`: the response is complete (and the
  // connection stays open when `keep_alive` and the request allowed it). The caller's thread
  // hands the bytes to the kernel itself when nothing is queued before them (no hop to an I/O
  // thread: a streamed token reaches the socket from the generation thread); what the kernel does
  // not take is queued for the I/O threads. Past ServerOptions::max_queued_bytes unsent, the client
  // is not reading: the connection is closed (its responder ClientGone()). One piece on an empty
  // queue is always taken (a large complete response).
  void Enqueue(std::string bytes, uint64_t generation, bool last, bool keep_alive) {
    {
      absl::MutexLock lock(&shared_->mu);
      if (shared_->stopped) return;
    }
    bool start_writing = false, close = false;
    {
      absl::MutexLock lock(&out_mu_);
      if (generation != generation_ || response_done_ || closed_ || closing_) return;
      if (!bytes.empty() && !writing_ && out_.empty()) {
        size_t sent = 0;
        while (sent < bytes.size()) {
          const ssize_t n = ::send(socket_.native_handle(), bytes.data() + sent,
                                   bytes.size() - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
          if (n > 0) {
            sent += static_cast<size_t>(n);
          } else if (n < 0 && errno == EINTR) {
            continue;
          } else {
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) close = true;
            break;
          }
        }
        if (!close && sent < bytes.size()) {
          bytes.erase(0, sent);
          queued_bytes_ += bytes.size();
          out_.push_back(std::move(bytes));
          writing_ = true;
          start_writing = true;
        }
      } else if (!bytes.empty()) {
        if (!out_.empty() && queued_bytes_ + bytes.size() > server_->options.max_queued_bytes) {
          HMOE_LOG(WARNING) << "HTTP client " << peer_
                            << " is not reading its response: " << queued_bytes_ + bytes.size()
                            << " bytes unsent, over the limit of "
                            << server_->options.max_queued_bytes
                            << "; closing the connection, which cancels its request";
          close = true;
        } else {
          queued_bytes_ += bytes.size();
          out_.push_back(std::move(bytes));
        }
      }
      if (close) {
        // No more writes; the strand closes the socket (and tells on_client_gone).
        closing_ = true;
        gone_.store(true);
      }
    }
    if (close) {
      asio::post(strand_, [self = shared_from_this()] { self->CloseNow(); });
      return;
    }
    if (start_writing) asio::post(strand_, [self = shared_from_this()] { self->WriteNext(); });
    if (last) {
      asio::post(strand_, [self = shared_from_this(), generation, keep_alive] {
        self->ResponseDone(generation, keep_alive);
      });
    }
  }

 private:
  // Strand only: the current response is complete.
  void ResponseDone(uint64_t generation, bool keep_alive) {
    bool idle;
    {
      absl::MutexLock lock(&out_mu_);
      if (generation != generation_ || closed_) return;
      response_done_ = true;
      keep_alive_ = keep_alive_ && keep_alive;
      idle = !writing_;
    }
    if (idle) AfterWrites();
  }

  void ReadRequest() {
    if (closed_) return;
    parser_.emplace();
    parser_->body_limit(server_->options.max_body_bytes);
    parser_->header_limit(static_cast<std::uint32_t>(server_->options.max_header_bytes));
    timed_out_ = false;
    timer_.expires_after(absl::ToChronoNanoseconds(server_->options.read_timeout));
    timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (ec) return;  // cancelled: the read finished first
      self->timed_out_ = true;
      self->socket_.cancel();
    });
    // The header first: a client that sent "Expect: 100-continue" (curl does for bodies over
    // 1 MB) waits for "100 Continue" before it sends the body.
    bhttp::async_read_header(
        socket_, buffer_, *parser_,
        asio::bind_executor(strand_, [self = shared_from_this()](beast::error_code ec, size_t) {
          if (ec || self->closed_ || self->parser_->is_done()) {
            self->OnRead(ec);
            return;
          }
          const auto& header = self->parser_->get();
          if (header.version() == 11 &&
              beast::iequals(header[bhttp::field::expect], "100-continue")) {
            self->continue_ = "HTTP/1.1 100 Continue\r\n\r\n";
            asio::async_write(
                self->socket_, asio::buffer(self->continue_),
                asio::bind_executor(self->strand_, [self](beast::error_code wec, size_t) {
                  if (wec) {
                    self->OnRead(wec);
                  } else {
                    self->ReadBody();
                  }
                }));
            return;
          }
          self->ReadBody();
        }));
  }

  void ReadBody() {
    bhttp::async_read(
        socket_, buffer_, *parser_,
        asio::bind_executor(strand_, [self = shared_from_this()](beast::error_code ec, size_t) {
          self->OnRead(ec);
        }));
  }

  void OnRead(beast::error_code ec) {
    timer_.cancel();
    if (closed_) return;
    if (timed_out_) {
      // Nothing at all yet on a keep-alive connection: just close; a started request gets 408.
      if (buffer_.size() > 0 || parser_->got_some()) {
        ErrorAndClose(408, "the request did not arrive completely within the read timeout");
      } else {
        CloseNow();
      }
      return;
    }
    if (ec == bhttp::error::end_of_stream || ec == asio::error::eof ||
        ec == asio::error::connection_reset || ec == asio::error::operation_aborted) {
      CloseNow();
      return;
    }
    if (ec == bhttp::error::body_limit) {
      ErrorAndClose(413, absl::StrCat("request body over the limit of ",
                                      server_->options.max_body_bytes, " bytes"));
      return;
    }
    if (ec == bhttp::error::header_limit) {
      ErrorAndClose(431, absl::StrCat("request headers over the limit of ",
                                      server_->options.max_header_bytes, " bytes"));
      return;
    }
    if (ec) {
      ErrorAndClose(400, absl::StrCat("malformed HTTP request: ", ec.message()));
      return;
    }
    bhttp::request<bhttp::string_body> msg = parser_->release();
    parser_.reset();
    if (msg.version() != 11) {
      ErrorAndClose(505, absl::StrCat("HTTP/", msg.version() / 10, ".", msg.version() % 10,
                                      " is not supported: use HTTP/1.1"));
      return;
    }
    Request request;
    request.method = std::string(msg.method_string());
    request.target = std::string(msg.target());
    request.path = request.target.substr(0, request.target.find('?'));
    request.body = std::move(msg.body());
    for (const auto& field : msg) {
      request.headers.emplace_back(absl::AsciiStrToLower(std::string(field.name_string())),
                                   std::string(field.value()));
    }
    {
      absl::MutexLock lock(&out_mu_);
      ++generation_;
      response_done_ = false;
      keep_alive_ = msg.keep_alive();
    }
    WatchForClose();
    server_->handler(std::move(request), MakeResponder());
  }

  // While a response is in progress: a readable socket is either the client's EOF/reset (it is
  // gone) or a pipelined next request (left for the next read).
  void WatchForClose() {
    if (closed_ || buffer_.size() > 0) return;
    socket_.async_wait(
        tcp::socket::wait_read,
        asio::bind_executor(
            strand_, [self = shared_from_this(), generation = generation_](beast::error_code ec) {
              if (self->closed_ || generation != self->generation_ || self->response_done_) return;
              if (ec) {
                if (ec != asio::error::operation_aborted) self->MarkGone();
                return;
              }
              char byte;
              const ssize_t n =
                  ::recv(self->socket_.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
              if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
                self->CloseNow();
              } else if (n < 0) {
                self->WatchForClose();
              }
              // n > 0: a pipelined request; it is read after this response.
            }));
  }

  std::shared_ptr<Responder> MakeResponder();

  // Strand only, with writing_ set and out_ not empty: writes out_ to the socket.
  void WriteNext() {
    asio::const_buffer front;
    {
      absl::MutexLock lock(&out_mu_);
      if (closed_ || out_.empty()) return;
      // std::deque keeps its elements in place while others are appended.
      front = asio::buffer(out_.front());
    }
    asio::async_write(
        socket_, front,
        asio::bind_executor(strand_, [self = shared_from_this()](beast::error_code ec, size_t) {
          if (self->closed_) return;
          if (ec) {
            self->CloseNow();
            return;
          }
          bool more, done;
          {
            absl::MutexLock lock(&self->out_mu_);
            self->queued_bytes_ -= self->out_.front().size();
            self->out_.pop_front();
            more = !self->out_.empty();
            self->writing_ = more;
            done = self->response_done_;
          }
          if (more) {
            self->WriteNext();
          } else if (done) {
            self->AfterWrites();
          }
        }));
  }

  void AfterWrites() {
    if (!keep_alive_) {
      LingerAndClose();
      return;
    }
    ReadRequest();
  }

  // Closing a socket with unread input sends a reset, which can destroy the response before the
  // client reads it (e.g. a 413 while the client still sends its body). So: end our side, read
  // and drop what the client still sends until it closes, for at most 2 s, then close.
  void LingerAndClose() {
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    timer_.expires_after(std::chrono::seconds(2));
    timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (!ec) self->CloseNow();
    });
    Drain();
  }

  void Drain() {
    drain_.resize(64 << 10);
    socket_.async_read_some(
        asio::buffer(drain_),
        asio::bind_executor(strand_, [self = shared_from_this()](beast::error_code ec, size_t) {
          if (self->closed_) return;
          if (ec) {
            self->CloseNow();
          } else {
            self->Drain();
          }
        }));
  }

  void ErrorAndClose(int status, absl::string_view message) {
    uint64_t generation;
    {
      absl::MutexLock lock(&out_mu_);
      generation = ++generation_;
      keep_alive_ = false;
      response_done_ = false;
    }
    std::string body = server_->options.error_body(status, message);
    std::string head = Head(status, server_->options.error_content_type,
                            absl::StrCat("Content-Length: ", body.size(), "\r\n"), false);
    Enqueue(head + body, generation, /*last=*/true, /*keep_alive=*/false);
  }

  // Strand only: the client is gone. The first time, while a response is in progress, tells
  // ServerOptions::on_client_gone.
  void MarkGone() {
    gone_.store(true);
    if (told_gone_ || response_done_) return;
    told_gone_ = true;
    if (server_->options.on_client_gone) server_->options.on_client_gone();
  }

  void CloseNow() {
    if (closed_) return;
    MarkGone();
    timer_.cancel();
    // Under out_mu_: no other thread is inside a send() on the descriptor being closed.
    absl::MutexLock lock(&out_mu_);
    closed_ = true;
    beast::error_code ignored;
    socket_.close(ignored);
    out_.clear();
    queued_bytes_ = 0;
  }

  // First member: outlives the socket and timer.
  std::shared_ptr<asio::io_context> io_;
  std::shared_ptr<Shared> shared_;
  Server::Impl* server_;
  asio::any_io_executor strand_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::string peer_ = "(unknown peer)";
  std::string continue_;
  std::string drain_;
  bool timed_out_ = false;
  // on_client_gone was called (strand only).
  bool told_gone_ = false;
  // The response's bytes and the state that responders (any thread) and the strand share. Written
  // under out_mu_; the strand-only writers (closed_, generation_, response_done_) are also read on
  // the strand without it.
  absl::Mutex out_mu_;
  std::deque<std::string> out_;
  size_t queued_bytes_ = 0;  // in out_
  // An async_write of out_.front() is in progress (or about to start).
  bool writing_ = false;
  // The client is given up (a failed send, a full queue): the strand closes the socket.
  bool closing_ = false;
  bool closed_ = false;
  bool response_done_ = true;
  bool keep_alive_ = true;
  // Counts requests: a responder writes only into its own request's response.
  uint64_t generation_ = 0;
  std::atomic<bool> gone_{false};
};

namespace {

class ConnectionResponder : public Responder {
 public:
  ConnectionResponder(std::shared_ptr<Connection> connection, uint64_t generation)
      : connection_(std::move(connection)), generation_(generation) {}

  void Send(int status, absl::string_view content_type, std::string body) override {
    if (Finish()) return;
    std::string bytes =
        Head(status, content_type, absl::StrCat("Content-Length: ", body.size(), "\r\n"), true) +
        body;
    connection_->Enqueue(std::move(bytes), generation_, /*last=*/true, /*keep_alive=*/true);
  }

  void StartStream(int status, absl::string_view content_type) override {
    std::string head = Head(status, content_type,
                            "Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n", true);
    connection_->Enqueue(std::move(head), generation_, /*last=*/false, /*keep_alive=*/true);
  }

  bool Write(std::string data) override {
    if (connection_->gone()) return false;
    if (data.empty()) return true;
    std::string chunk = absl::StrCat(absl::Hex(data.size()), "\r\n", data, "\r\n");
    connection_->Enqueue(std::move(chunk), generation_, /*last=*/false, /*keep_alive=*/true);
    return true;
  }

  void End() override {
    if (Finish()) return;
    connection_->Enqueue("0\r\n\r\n", generation_, /*last=*/true, /*keep_alive=*/true);
  }

  bool ClientGone() const override { return connection_->gone(); }

 private:
  // True when the response was already finished.
  bool Finish() { return finished_.exchange(true); }

  std::shared_ptr<Connection> connection_;
  const uint64_t generation_;
  std::atomic<bool> finished_{false};
};

}  // namespace

std::shared_ptr<Responder> Connection::MakeResponder() {
  return std::make_shared<ConnectionResponder>(shared_from_this(), generation_);
}

void Server::Impl::Accept() {
  acceptor.async_accept(asio::make_strand(*io), [this](beast::error_code ec, tcp::socket socket) {
    if (ec) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
      Accept();
      return;
    }
    if (shared->open_connections.load() >= options.max_connections) {
      // Over the limit: a short answer written at once, then closed.
      std::string body = options.error_body(
          503, absl::StrCat("too many connections (limit ", options.max_connections, ")"));
      std::string bytes = Head(503, options.error_content_type,
                               absl::StrCat("Content-Length: ", body.size(), "\r\n"), false) +
                          body;
      beast::error_code ignored;
      socket.non_blocking(true, ignored);
      socket.send(asio::buffer(bytes), 0, ignored);
      socket.close(ignored);
    } else {
      beast::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      auto connection = std::make_shared<Connection>(this, std::move(socket));
      {
        absl::MutexLock lock(&mu);
        // Drop the entries of closed connections now and then.
        if (connections.size() > 64 &&
            connections.size() > 2 * static_cast<size_t>(shared->open_connections.load())) {
          std::erase_if(connections, [](const auto& w) { return w.expired(); });
        }
        connections.push_back(connection);
      }
      connection->Start();
    }
    Accept();
  });
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() { Stop(); }

int Server::port() const { return impl_->port; }

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const std::string& host_port,
                                                      ServerOptions options, Handler handler) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP address \"", host_port, "\": expected HOST:PORT"));
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  int port = 0;
  if (!absl::SimpleAtoi(host_port.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP address \"", host_port, "\": the port must be 0..65535"));
  }
  if (options.io_threads < 1 || options.max_connections < 1) {
    return absl::InvalidArgumentError("HTTP server: io_threads and max_connections must be >= 1");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->handler = std::move(handler);
  beast::error_code ec;
  tcp::resolver resolver(*impl->io);
  auto endpoints = resolver.resolve(host, std::to_string(port), ec);
  if (ec || endpoints.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP address \"", host_port, "\": cannot resolve the host: ", ec.message()));
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  impl->acceptor.open(endpoint.protocol(), ec);
  // SO_REUSEADDR only lets us bind over connections in TIME_WAIT; on Linux a second listener on
  // the same port still fails (no SO_REUSEPORT).
  if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", host_port, ": ", ec.message(),
                                               " (the address is in use, or not local)"));
  }
  impl->port = impl->acceptor.local_endpoint().port();
  impl->work.emplace(impl->io->get_executor());
  impl->Accept();
  for (int i = 0; i < impl->options.io_threads; ++i) {
    impl->threads.emplace_back([io = impl->io.get()] { io->run(); });
  }
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

void Server::StopAccepting() {
  if (impl_->accepting_stopped) return;
  impl_->accepting_stopped = true;
  asio::post(impl_->acceptor.get_executor(), [impl = impl_.get()] {
    beast::error_code ignored;
    impl->acceptor.close(ignored);
  });
  absl::MutexLock lock(&impl_->mu);
  for (auto& w : impl_->connections) {
    if (auto c = w.lock()) c->Close();
  }
}

void Server::Stop() {
  if (impl_->stopped) return;
  StopAccepting();
  impl_->stopped = true;
  {
    absl::MutexLock lock(&impl_->shared->mu);
    impl_->shared->stopped = true;
  }
  {
    // Connections accepted after StopAccepting's pass.
    absl::MutexLock lock(&impl_->mu);
    for (auto& w : impl_->connections) {
      if (auto c = w.lock()) {
        asio::post(*impl_->io, [c] { c->Close(); });
      }
    }
  }
  // Every socket and timer is closed: the I/O threads run out of work and return.
  impl_->work.reset();
  for (std::thread& t : impl_->threads) t.join();
  impl_->threads.clear();
}

}  // namespace hmoe::http

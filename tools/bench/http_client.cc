#include "tools/bench/http_client.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace hmoe::bench {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

void SseParser::Feed(absl::string_view bytes, const OnData& on_data) {
  pending_.append(bytes.data(), bytes.size());
  size_t start = 0;
  for (size_t nl; (nl = pending_.find('\n', start)) != std::string::npos; start = nl + 1) {
    absl::string_view line(pending_.data() + start, nl - start);
    absl::ConsumeSuffix(&line, "\r");
    if (line.empty()) {
      if (has_data_) on_data(data_);
      data_.clear();
      has_data_ = false;
      continue;
    }
    if (line.front() == ':') continue;  // a comment
    const size_t colon = line.find(':');
    const absl::string_view field = line.substr(0, colon);
    absl::string_view value =
        colon == absl::string_view::npos ? absl::string_view() : line.substr(colon + 1);
    absl::ConsumePrefix(&value, " ");
    if (field != "data") continue;
    if (has_data_) data_.push_back('\n');
    data_.append(value.data(), value.size());
    has_data_ = true;
  }
  pending_.erase(0, start);
}

struct HttpClient::Impl {
  asio::io_context io;
  beast::tcp_stream stream{io};
  beast::flat_buffer buffer;
  std::string host;
};

HttpClient::HttpClient() : impl_(std::make_unique<Impl>()) {}
HttpClient::~HttpClient() = default;

absl::Status HttpClient::Connect(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == host_port.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-addr: expected HOST:PORT, got \"", host_port, "\""));
  }
  impl_->host = host_port;
  beast::error_code ec;
  tcp::resolver resolver(impl_->io);
  auto endpoints = resolver.resolve(host_port.substr(0, colon), host_port.substr(colon + 1), ec);
  if (!ec) asio::connect(impl_->stream.socket(), endpoints, ec);
  if (!ec) impl_->stream.socket().set_option(tcp::no_delay(true), ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("connect to ", host_port, ": ", ec.message()));
  }
  return absl::OkStatus();
}

HttpResponse HttpClient::Post(const std::string& path, const std::string& body,
                              const SseParser::OnData& on_data, const std::function<void()>& sent,
                              absl::Duration timeout) {
  HttpResponse out;
  bhttp::request<bhttp::string_body> req{bhttp::verb::post, path, 11};
  req.set(bhttp::field::host, impl_->host);
  req.set(bhttp::field::content_type, "application/json");
  req.body() = body;
  req.prepare_payload();
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(64 << 20);
  SseParser sse;
  std::function<size_t(std::uint64_t, beast::string_view, beast::error_code&)> on_chunk =
      [&](std::uint64_t, beast::string_view data, beast::error_code&) -> size_t {
    // Only an event stream is split into events; any other chunked body is kept whole.
    if (parser.get().result_int() == 200) {
      sse.Feed(absl::string_view(data.data(), data.size()), on_data);
    } else {
      out.body.append(data.data(), data.size());
    }
    return data.size();
  };
  parser.on_chunk_body(on_chunk);
  beast::error_code ec;
  // Asynchronous operations on this client's own io_context, run here until the exchange ends:
  // only they honour the stream's expiry (a blocking read would wait forever on a silent server).
  // The expiry is one point in time for the write and every read, so `timeout` bounds the whole
  // exchange; when it passes, the stream closes the socket and the pending operation fails with
  // beast::error::timeout.
  if (timeout == absl::InfiniteDuration()) {
    impl_->stream.expires_never();
  } else {
    impl_->stream.expires_after(absl::ToChronoNanoseconds(timeout));
  }
  if (sent) sent();
  bhttp::async_write(impl_->stream, req, [&](beast::error_code wec, size_t) {
    if (wec) {
      ec = wec;
      return;
    }
    bhttp::async_read(impl_->stream, impl_->buffer, parser,
                      [&](beast::error_code rec, size_t) { ec = rec; });
  });
  impl_->io.restart();
  impl_->io.run();
  impl_->stream.expires_never();
  if (parser.is_header_done()) out.status = static_cast<int>(parser.get().result_int());
  if (ec) {
    out.transport_error = ec == beast::error::timeout
                              ? absl::StrCat("no complete answer within ",
                                             absl::FormatDuration(timeout), " (client deadline)")
                              : ec.message();
    return out;
  }
  if (!parser.chunked()) {
    out.body = parser.get().body();
  }
  if (sse.pending() > 0) out.transport_error = "the event stream ended inside an event";
  out.keep_alive = parser.keep_alive();
  return out;
}

}  // namespace hmoe::bench

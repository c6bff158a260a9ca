#pragma once

// A small HTTP/1.1 client for the router's OpenAI-compatible API (docs/api.md), shared by
// `hmoe http-bench` and `hmoe bench --protocol http`: one keep-alive connection (Boost.Beast),
// a POST whose text/event-stream answer is handed over event by event as it arrives. SseParser is
// the pure part (bytes in, events' data out), unit-tested on hand-made byte strings.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace hmoe::bench {

// Splits a text/event-stream body into events: an event ends at an empty line ("\n\n"; "\r\n"
// line ends are accepted too) and its data is the value of its "data:" lines (one leading space
// dropped; several data lines joined by '\n'). Lines of other fields and comments (":...") are
// ignored; an event without data is not reported. Bytes may arrive split anywhere.
class SseParser {
 public:
  using OnData = std::function<void(absl::string_view data)>;
  // Appends `bytes` and calls `on_data` once for each event they complete, in order.
  void Feed(absl::string_view bytes, const OnData& on_data);
  // Bytes of an event not yet ended (a stream that stops with this > 0 was cut).
  size_t pending() const { return pending_.size() + (has_data_ ? 1 : 0); }

 private:
  std::string pending_;  // bytes after the last complete line
  std::string data_;     // the data of the event being read
  bool has_data_ = false;
};

// The end of one POST: the HTTP status (0 when no response came), the body of a non-streamed
// answer (an error's JSON), or the transport error.
struct HttpResponse {
  int status = 0;
  std::string body;
  std::string transport_error;  // empty when the exchange completed
  bool keep_alive = false;      // the connection may carry another request
};

// One connection to HOST:PORT; not thread-safe (one request at a time).
class HttpClient {
 public:
  HttpClient();
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // InvalidArgument for an address without a port; Unavailable when the connection fails.
  absl::Status Connect(const std::string& host_port);
  // POSTs `body` (JSON) to `path` and reads the whole answer; each event of a text/event-stream
  // answer goes to `on_data` as its bytes arrive. `sent` (when set) is called just before the
  // request is written, for the caller's clock. `timeout` bounds the whole exchange (writing the
  // request and reading every byte of the answer): past it the connection is closed and
  // transport_error says so (the answer's status and the events read so far are kept).
  HttpResponse Post(const std::string& path, const std::string& body,
                    const SseParser::OnData& on_data, const std::function<void()>& sent = {},
                    absl::Duration timeout = absl::InfiniteDuration());

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hmoe::bench

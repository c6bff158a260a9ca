#pragma once

// A minimal blocking HTTP/1.1 client over raw sockets for tests: sends exactly the bytes a test
// wants (malformed requests included) and reads one response (Content-Length, chunked or
// until close). Every read waits at most 60 s (SO_RCVTIMEO), so a broken server fails the test
// instead of hanging it.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace hmoe::testing {

struct HttpResponse {
  int status = 0;  // 0: no response (closed, or timed out)
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-case
  std::string body;                                          // de-chunked
  bool closed = false;  // the server closed the connection after it

  std::string Header(const std::string& name) const {
    for (const auto& [k, v] : headers) {
      if (k == name) return v;
    }
    return "";
  }
};

class HttpConnection {
 public:
  // `receive_buffer` > 0: SO_RCVBUF before connecting (a small window: a client that does not
  // read stops the server's writes soon).
  explicit HttpConnection(int port, int timeout_s = 60, int receive_buffer = 0) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (receive_buffer > 0) {
      ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
    }
    timeval tv{timeout_s, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) Close();
  }
  ~HttpConnection() { Close(); }
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  bool ok() const { return fd_ >= 0; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  bool Send(const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }

  // A request with a body (Content-Length) and Connection: keep-alive.
  bool SendRequest(const std::string& method, const std::string& path, const std::string& body,
                   const std::string& version = "HTTP/1.1") {
    return Send(absl::StrCat(method, " ", path, " ", version,
                             "\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                             "Content-Length: ",
                             body.size(), "\r\n\r\n", body));
  }

  // Reads the status line and headers; false when the connection closed first.
  bool ReadHead(HttpResponse* r) {
    size_t end;
    while ((end = buf_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill()) {
        r->closed = true;
        return false;
      }
    }
    std::vector<std::string> lines = absl::StrSplit(buf_.substr(0, end), "\r\n");
    buf_.erase(0, end + 4);
    std::vector<std::string> status_line = absl::StrSplit(lines[0], absl::MaxSplits(' ', 2));
    if (status_line.size() < 2 || !absl::SimpleAtoi(status_line[1], &r->status)) return false;
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      if (colon == std::string::npos) continue;
      r->headers.emplace_back(absl::AsciiStrToLower(lines[i].substr(0, colon)),
                              std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1))));
    }
    return true;
  }

  // The next chunk of a chunked body ("" at the end or on error; *end set at the last chunk).
  std::string ReadChunk(bool* end) {
    *end = false;
    size_t eol;
    while ((eol = buf_.find("\r\n")) == std::string::npos) {
      if (!Fill()) {
        *end = true;
        return "";
      }
    }
    const size_t size = std::strtoul(buf_.substr(0, eol).c_str(), nullptr, 16);
    buf_.erase(0, eol + 2);
    while (buf_.size() < size + 2) {
      if (!Fill()) {
        *end = true;
        return "";
      }
    }
    std::string data = buf_.substr(0, size);
    buf_.erase(0, size + 2);
    if (size == 0) *end = true;
    return data;
  }

  HttpResponse ReadResponse() {
    HttpResponse r;
    if (!ReadHead(&r)) return r;
    if (absl::AsciiStrToLower(r.Header("transfer-encoding")) == "chunked") {
      bool end = false;
      while (!end) r.body += ReadChunk(&end);
    } else {
      size_t length = 0;
      if (!absl::SimpleAtoi(r.Header("content-length"), &length)) length = 0;
      while (buf_.size() < length && Fill()) {
      }
      r.body = buf_.substr(0, length);
      buf_.erase(0, std::min(length, buf_.size()));
    }
    if (absl::AsciiStrToLower(r.Header("connection")) == "close") {
      r.closed = !Fill();
    }
    return r;
  }

  // True when the server closed the connection (read returns 0 or an error other than a
  // timeout).
  bool WaitClosed() {
    char c;
    const ssize_t n = ::recv(fd_, &c, 1, 0);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }

 private:
  bool Fill() {
    char tmp[65536];
    const ssize_t n = ::recv(fd_, tmp, sizeof(tmp), 0);
    if (n <= 0) return false;
    buf_.append(tmp, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  std::string buf_;
};

// One request on a new connection.
inline HttpResponse HttpCall(int port, const std::string& method, const std::string& path,
                             const std::string& body = "") {
  HttpConnection c(port);
  if (!c.ok() || !c.SendRequest(method, path, body)) return {};
  return c.ReadResponse();
}

// The `data: ...` payloads of a server-sent event stream.
inline std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  for (absl::string_view event : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&event, "data: ")) out.emplace_back(event);
  }
  return out;
}

}  // namespace hmoe::testing

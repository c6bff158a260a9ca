#pragma once

// hmoe-router's flags (defined in flags.cc) and --model's config.json, read and checked, so that
// main.cc reads as the router's life: start, serve, drain.

#include <memory>
#include <string>

#include "absl/status/status.h"

#include "common/model/tokenizer.h"
#include "router/router.h"

namespace hmoe::router {

struct RouterFlags {
  RouterOptions options;
  std::unique_ptr<Tokenizer> tokenizer;  // the model's, when it has one
  std::string model_dir;                 // --model; empty without one
  std::string listen;
  std::string registry_socket;  // empty: the registry is served on `listen`
  std::string port_file;
  double drain_seconds = 0;
  int heartbeat_timeout_ms = 0;
  int heartbeat_interval_ms = 0;
};

// Reads and checks every flag (a process::FlagError names the bad one; a config.json or tokenizer
// that does not load is a plain error) and prepares the registry socket's folder.
absl::Status ReadFlags(RouterFlags& f);

}  // namespace hmoe::router

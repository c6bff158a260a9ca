#pragma once

// Channel arguments of the router's connections to its workers (unix sockets on the same node).

#include <grpcpp/support/channel_arguments.h>

namespace hmoe::router {

// gRPC backs off up to 120 s between reconnects to an unreachable server and fails calls at once
// meanwhile. A worker that supervisord restarts is back within about a second, and reconnecting
// to a local socket is cheap, so keep the backoff short: a request retried after a worker's death
// reaches the new process as soon as it has registered.
inline grpc::ChannelArguments WorkerChannelArguments() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  return args;
}

}  // namespace hmoe::router

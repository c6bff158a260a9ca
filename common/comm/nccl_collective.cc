// NcclCollective (see nccl_collective.h). Host code only: NCCL and the CUDA runtime API.

#include "common/comm/nccl_collective.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include <nccl.h>

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/cuda_check.h"
#include "common/device/native_stream.h"

namespace hmoe {
namespace {

// `comm`, when given, adds NCCL's own account of the last error (ncclGetLastError), e.g.
// "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 6000" for two ranks on one GPU,
// which NCCL does not support (NVIDIA/nccl#1241).
absl::Status NcclStatus(ncclResult_t r, const char* expr, ncclComm_t comm = nullptr) {
  const absl::StatusCode code =
      r == ncclRemoteError || r == ncclSystemError        ? absl::StatusCode::kUnavailable
      : r == ncclInvalidArgument || r == ncclInvalidUsage ? absl::StatusCode::kInvalidArgument
                                                          : absl::StatusCode::kInternal;
  std::string message = absl::StrCat("nccl: ", expr, " failed: ", ncclGetErrorString(r));
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&message, " (", last, ")");
  if (r == ncclInvalidUsage) {
    absl::StrAppend(&message, "; NCCL needs one GPU per rank: a DSLP group cannot put two ranks ",
                    "on one GPU");
  }
  return absl::Status(code, message);
}

// Non-blocking communicators may return ncclInProgress; that is not an error.
#define HMOE_NCCL_RETURN_IF_ERROR(expr)                                  \
  do {                                                                   \
    if (const ncclResult_t hmoe_nccl_r_ = (expr);                        \
        hmoe_nccl_r_ != ncclSuccess && hmoe_nccl_r_ != ncclInProgress) { \
      return NcclStatus(hmoe_nccl_r_, #expr);                            \
    }                                                                    \
  } while (false)

class NcclCollective final : public Collective {
 public:
  NcclCollective(const NcclCollectiveOptions& options, ncclComm_t comm)
      : options_(options), comm_(comm) {
    counters_.bytes_sent.assign(options.world_size, 0);
    counters_.bytes_received.assign(options.world_size, 0);
  }

  ~NcclCollective() override {
    if (barrier_stream_ != nullptr) HMOE_CUDA_LOG_IF_ERROR(cudaStreamDestroy(barrier_stream_));
    if (barrier_word_ != nullptr) HMOE_CUDA_LOG_IF_ERROR(cudaFree(barrier_word_));
    if (comm_ == nullptr || aborted_) return;
    // A communicator whose peers are gone may never finalize: abort (frees it) instead.
    if (ncclCommAbort(comm_) != ncclSuccess) HMOE_LOG(ERROR) << "nccl: ncclCommAbort failed";
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  std::string description() const override { return "nccl"; }

  // Waits until the communicator has no call in progress (non-blocking mode), bounded.
  absl::Status WaitComm(absl::Time deadline) {
    while (true) {
      ncclResult_t state = ncclSuccess;
      HMOE_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm_, &state));
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return Fail(NcclStatus(state, "async", comm_));
      if (absl::Now() > deadline) {
        return Fail(absl::UnavailableError("nccl: a peer did not respond within the timeout"));
      }
      absl::SleepFor(absl::Microseconds(100));
    }
  }

  absl::Status AllGatherV(Stream& stream, const void* send, void* recv,
                          std::span<const size_t> counts,
                          std::span<const size_t> offsets) override {
    HMOE_RETURN_IF_ERROR(ValidateLayout(world_size(), counts, offsets, "all-gather"));
    std::vector<size_t> send_counts(world_size(), counts[rank()]), send_offsets(world_size(), 0);
    return SendRecv(stream, send, send_counts, send_offsets, recv, counts, offsets,
                    /*same_send=*/true);
  }

  absl::Status AllToAllV(Stream& stream, const void* send, std::span<const size_t> send_counts,
                         std::span<const size_t> send_offsets, void* recv,
                         std::span<const size_t> recv_counts,
                         std::span<const size_t> recv_offsets) override {
    HMOE_RETURN_IF_ERROR(ValidateLayout(world_size(), send_counts, send_offsets, "all-to-all"));
    HMOE_RETURN_IF_ERROR(ValidateLayout(world_size(), recv_counts, recv_offsets, "all-to-all"));
    return SendRecv(stream, send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                    /*same_send=*/false);
  }

  absl::Status RingSendRecv(Stream& stream, const void* send, size_t send_bytes, void* recv,
                            size_t recv_bytes) override {
    HMOE_ASSIGN_OR_RETURN(cudaStream_t s, Native(stream));
    const int next = (rank() + 1) % world_size();
    const int prev = (rank() - 1 + world_size()) % world_size();
    if (world_size() == 1) {
      if (send_bytes != recv_bytes) return absl::InvalidArgumentError("ring: sizes differ");
      HMOE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(recv, send, send_bytes, cudaMemcpyDeviceToDevice, s));
      return absl::OkStatus();
    }
    HMOE_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    HMOE_NCCL_RETURN_IF_ERROR(ncclSend(send, send_bytes, ncclUint8, next, comm_, s));
    HMOE_NCCL_RETURN_IF_ERROR(ncclRecv(recv, recv_bytes, ncclUint8, prev, comm_, s));
    HMOE_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
    counters_.bytes_sent[next] += send_bytes;
    counters_.bytes_received[prev] += recv_bytes;
    ++counters_.num_ops;
    return Finish(s);
  }

  absl::Status AllReduceSum(Stream& stream, const float* send, float* recv, size_t count) override {
    HMOE_ASSIGN_OR_RETURN(cudaStream_t s, Native(stream));
    HMOE_NCCL_RETURN_IF_ERROR(ncclAllReduce(send, recv, count, ncclFloat32, ncclSum, comm_, s));
    // Ring all-reduce: each rank sends about 2 (S - 1) / S of the vector to its ring successor.
    const int next = (rank() + 1) % world_size();
    const int prev = (rank() - 1 + world_size()) % world_size();
    if (world_size() > 1) {
      const uint64_t bytes = 2 * count * sizeof(float) * (world_size() - 1) / world_size();
      counters_.bytes_sent[next] += bytes;
      counters_.bytes_received[prev] += bytes;
    }
    ++counters_.num_ops;
    return Finish(s);
  }

  absl::Status Barrier() override {
    if (barrier_stream_ == nullptr) {
      HMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.cuda_ordinal));
      HMOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&barrier_stream_, cudaStreamNonBlocking));
      HMOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&barrier_word_, sizeof(float)));
    }
    HMOE_NCCL_RETURN_IF_ERROR(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum,
                                            comm_, barrier_stream_));
    return WaitStream(barrier_stream_);
  }

  CommCounters counters() const override { return counters_; }
  void ResetCounters() override {
    counters_ = CommCounters();
    counters_.bytes_sent.assign(world_size(), 0);
    counters_.bytes_received.assign(world_size(), 0);
  }

 private:
  absl::StatusOr<cudaStream_t> Native(Stream& stream) {
    if (aborted_) return absl::UnavailableError("nccl: the communicator was aborted; re-form");
    void* s = NativeCudaStream(stream);
    if (s == nullptr) {
      return absl::InvalidArgumentError("nccl: collectives need a CUDA device stream");
    }
    HMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.cuda_ordinal));
    return static_cast<cudaStream_t>(s);
  }

  absl::Status SendRecv(Stream& stream, const void* send, std::span<const size_t> send_counts,
                        std::span<const size_t> send_offsets, void* recv,
                        std::span<const size_t> recv_counts, std::span<const size_t> recv_offsets,
                        bool same_send) {
    HMOE_ASSIGN_OR_RETURN(cudaStream_t s, Native(stream));
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    const int me = rank();
    if (recv_counts[me] > 0) {
      HMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out + recv_offsets[me],
                                                in + (same_send ? 0 : send_offsets[me]),
                                                recv_counts[me], cudaMemcpyDeviceToDevice, s));
    }
    HMOE_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (int p = 0; p < world_size(); ++p) {
      if (p == me) continue;
      HMOE_NCCL_RETURN_IF_ERROR(
          ncclSend(in + send_offsets[p], send_counts[p], ncclUint8, p, comm_, s));
      HMOE_NCCL_RETURN_IF_ERROR(
          ncclRecv(out + recv_offsets[p], recv_counts[p], ncclUint8, p, comm_, s));
      counters_.bytes_sent[p] += send_counts[p];
      counters_.bytes_received[p] += recv_counts[p];
    }
    HMOE_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
    ++counters_.num_ops;
    return Finish(s);
  }

  // After enqueueing: wait for the (non-blocking) group call, then, when synchronous, for the
  // stream, both bounded by peer_timeout.
  absl::Status Finish(cudaStream_t s) {
    HMOE_RETURN_IF_ERROR(WaitComm(absl::Now() + options_.peer_timeout));
    if (!options_.synchronous) return absl::OkStatus();
    return WaitStream(s);
  }

  absl::Status WaitStream(cudaStream_t s) {
    const absl::Time deadline = absl::Now() + options_.peer_timeout;
    while (true) {
      const cudaError_t q = cudaStreamQuery(s);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) HMOE_CUDA_RETURN_IF_ERROR(q);
      HMOE_RETURN_IF_ERROR(WaitComm(deadline));
      if (absl::Now() > deadline) {
        return Fail(absl::UnavailableError(absl::StrCat("nccl: a collective did not finish within ",
                                                        absl::FormatDuration(options_.peer_timeout),
                                                        " (a peer died?)")));
      }
      absl::SleepFor(absl::Microseconds(50));
    }
  }

  absl::Status Fail(absl::Status s) {
    if (!aborted_) {
      aborted_ = true;
      if (ncclCommAbort(comm_) != ncclSuccess) HMOE_LOG(ERROR) << "nccl: ncclCommAbort failed";
    }
    return absl::UnavailableError(absl::StrCat(s.message(), "; the group must re-form"));
  }

  const NcclCollectiveOptions options_;
  ncclComm_t comm_;
  bool aborted_ = false;
  CommCounters counters_;
  cudaStream_t barrier_stream_ = nullptr;
  void* barrier_word_ = nullptr;
};

}  // namespace

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  HMOE_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<Collective>> NewNcclCollective(
    const NcclCollectiveOptions& options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: rank ", options.rank, " of world size ", options.world_size));
  }
  ncclUniqueId id;
  if (options.unique_id.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(absl::StrCat("nccl: unique id of ", options.unique_id.size(),
                                                   " bytes, expected ", sizeof(id.internal)));
  }
  std::memcpy(id.internal, options.unique_id.data(), sizeof(id.internal));
  HMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.cuda_ordinal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  HMOE_NCCL_RETURN_IF_ERROR(
      ncclCommInitRankConfig(&comm, options.world_size, id, options.rank, &config));
  auto collective = std::make_unique<NcclCollective>(options, comm);
  HMOE_RETURN_IF_ERROR(collective->WaitComm(absl::Now() + options.peer_timeout));
  return std::unique_ptr<Collective>(std::move(collective));
}

}  // namespace hmoe

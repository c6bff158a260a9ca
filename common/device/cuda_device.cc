// CudaDevice: the Device on an NVIDIA GPU. Built only with the CUDA option (see CMakeLists.txt;
// cuda_device_stub.cc otherwise).
//
// Status (issue #8): memory (with the shared MemoryBudget), streams, events and copies are
// implemented on the CUDA runtime; the compute ops return Unimplemented until the CUDA kernels
// land (the CUDA engineer fills them in: one Launch*() per kernel in common/kernels/cuda, errors
// turned into Status here). Host code only: no kernels in this file.

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/device.h"
#include "common/device/memory_budget.h"
#include "common/kernels/cuda/cuda_backend.h"

#define HMOE_CUDA_RETURN_IF_ERROR(expr)                                                       \
  do {                                                                                        \
    if (const cudaError_t hmoe_err_ = (expr); hmoe_err_ != cudaSuccess) {                     \
      return absl::InternalError(absl::StrCat(#expr, " failed: ", cudaGetErrorName(hmoe_err_), \
                                              " (", cudaGetErrorString(hmoe_err_), ")"));     \
    }                                                                                         \
  } while (false)

#define HMOE_CUDA_LOG_IF_ERROR(expr)                                                   \
  do {                                                                                 \
    if (const cudaError_t hmoe_err_ = (expr); hmoe_err_ != cudaSuccess) {              \
      HMOE_LOG(ERROR) << #expr << " failed: " << cudaGetErrorName(hmoe_err_);          \
    }                                                                                  \
  } while (false)

namespace hmoe {
namespace {

absl::Status Unimplemented(const char* op) {
  return absl::UnimplementedError(absl::StrCat("cuda device: ", op, " is not implemented yet"));
}

struct CudaMemory {
  CudaMemory(int ordinal, size_t budget) : ordinal(ordinal), budget(budget) {}
  int ordinal;
  MemoryBudget budget;
};

void FreeCudaBuffer(void* context, void* data, size_t size_bytes) {
  auto* memory = static_cast<CudaMemory*>(context);
  HMOE_CUDA_LOG_IF_ERROR(cudaSetDevice(memory->ordinal));
  HMOE_CUDA_LOG_IF_ERROR(cudaFree(data));
  memory->budget.Release(size_bytes);
}

class CudaStream final : public Stream {
 public:
  explicit CudaStream(cudaStream_t stream) : stream_(stream) {}
  ~CudaStream() override { HMOE_CUDA_LOG_IF_ERROR(cudaStreamDestroy(stream_)); }
  cudaStream_t get() const { return stream_; }

  absl::Status Synchronize() override {
    HMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  absl::Status WaitEvent(Event& event) override;

 private:
  cudaStream_t stream_;
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  ~CudaEvent() override { HMOE_CUDA_LOG_IF_ERROR(cudaEventDestroy(event_)); }
  cudaEvent_t get() const { return event_; }

  absl::Status Record(Stream& stream) override {
    HMOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, static_cast<CudaStream&>(stream).get()));
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    HMOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
    return absl::OkStatus();
  }
  bool IsComplete() override { return cudaEventQuery(event_) == cudaSuccess; }

 private:
  cudaEvent_t event_;
};

absl::Status CudaStream::WaitEvent(Event& event) {
  HMOE_CUDA_RETURN_IF_ERROR(
      cudaStreamWaitEvent(stream_, static_cast<CudaEvent&>(event).get(), 0));
  return absl::OkStatus();
}

cudaStream_t Raw(Stream& stream) { return static_cast<CudaStream&>(stream).get(); }

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, size_t budget)
      : ordinal_(ordinal), memory_(std::make_unique<CudaMemory>(ordinal, budget)) {}

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return absl::StrCat("cuda:", ordinal_); }
  bool host_accessible() const override { return false; }

  absl::StatusOr<DeviceBuffer> Allocate(size_t size_bytes) override {
    if (size_bytes == 0) return absl::InvalidArgumentError("cuda device: allocate 0 bytes");
    HMOE_RETURN_IF_ERROR(memory_->budget.Reserve(size_bytes, "cuda device allocate"));
    return Make(size_bytes);
  }
  absl::StatusOr<DeviceBuffer> AllocateBlocking(size_t size_bytes, absl::Time deadline) override {
    if (size_bytes == 0) return absl::InvalidArgumentError("cuda device: allocate 0 bytes");
    HMOE_RETURN_IF_ERROR(
        memory_->budget.ReserveBlocking(size_bytes, deadline, "cuda device allocate"));
    return Make(size_bytes);
  }
  size_t bytes_in_use() const override { return memory_->budget.bytes_in_use(); }
  size_t peak_bytes_in_use() const override { return memory_->budget.peak_bytes_in_use(); }
  void ResetPeakBytes() override { memory_->budget.ResetPeak(); }
  size_t budget_bytes() const override { return memory_->budget.budget_bytes(); }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    HMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    cudaStream_t stream = nullptr;
    HMOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return std::unique_ptr<Stream>(new CudaStream(stream));
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    HMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    cudaEvent_t event = nullptr;
    HMOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return std::unique_ptr<Event>(new CudaEvent(event));
  }
  absl::Status Synchronize() override {
    HMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    HMOE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    return absl::OkStatus();
  }

  absl::Status CopyToDevice(Stream& s, void* dst, const void* src, size_t bytes) override {
    return Copy(s, dst, src, bytes, cudaMemcpyHostToDevice);
  }
  absl::Status CopyToHost(Stream& s, void* dst, const void* src, size_t bytes) override {
    return Copy(s, dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  absl::Status CopyOnDevice(Stream& s, void* dst, const void* src, size_t bytes) override {
    return Copy(s, dst, src, bytes, cudaMemcpyDeviceToDevice);
  }
  absl::Status Memset(Stream& s, void* dst, int value, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    HMOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, Raw(s)));
    return absl::OkStatus();
  }

  absl::Status Linear(Stream&, const LinearWeight&, const float*, int64_t, int64_t, float*,
                      int64_t) override {
    return Unimplemented("Linear");
  }
  absl::Status RmsNorm(Stream&, const float*, int64_t, int64_t, int64_t, const VectorWeight&,
                       float, float*, int64_t) override {
    return Unimplemented("RmsNorm");
  }
  absl::Status RopeInterleaved(Stream&, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                               const int32_t*, const float*, float) override {
    return Unimplemented("RopeInterleaved");
  }
  absl::Status SiluMul(Stream&, const float*, const float*, int64_t, float*) override {
    return Unimplemented("SiluMul");
  }
  absl::Status Add(Stream&, const float*, const float*, int64_t, float*) override {
    return Unimplemented("Add");
  }
  absl::Status EmbeddingGather(Stream&, const LinearWeight&, const int32_t*, int64_t,
                               float*) override {
    return Unimplemented("EmbeddingGather");
  }
  absl::Status MoeGate(Stream&, const float*, int64_t, int64_t, const LinearWeight&,
                       const VectorWeight&, const MoeGateParams&, int32_t*, float*) override {
    return Unimplemented("MoeGate");
  }
  absl::Status KvCacheWrite(Stream&, const KvLayerView&, const int32_t*, int64_t, const float*,
                            int64_t, const float*, int64_t, int64_t) override {
    return Unimplemented("KvCacheWrite");
  }
  absl::Status MlaDecodeAttention(Stream&, const MlaAttentionArgs&) override {
    return Unimplemented("MlaDecodeAttention");
  }
  absl::Status MlaPrefillAttention(Stream&, const MlaAttentionArgs&) override {
    return Unimplemented("MlaPrefillAttention");
  }
  absl::Status GatherRows(Stream&, const float*, int64_t, const int32_t*, int64_t, int64_t,
                          float*, int64_t) override {
    return Unimplemented("GatherRows");
  }
  absl::Status ScatterAddRows(Stream&, const float*, int64_t, const int32_t*, const float*,
                              int64_t, int64_t, float*, int64_t) override {
    return Unimplemented("ScatterAddRows");
  }

 private:
  absl::StatusOr<DeviceBuffer> Make(size_t size_bytes) {
    void* data = nullptr;
    if (cudaSetDevice(ordinal_) != cudaSuccess ||
        cudaMalloc(&data, size_bytes) != cudaSuccess) {
      cudaGetLastError();  // out-of-memory is not sticky
      memory_->budget.Release(size_bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat(name(), ": cudaMalloc of ", size_bytes, " bytes failed"));
    }
    return DeviceBuffer(data, size_bytes, &FreeCudaBuffer, memory_.get());
  }

  absl::Status Copy(Stream& s, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return absl::OkStatus();
    HMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, Raw(s)));
    return absl::OkStatus();
  }

  const int ordinal_;
  std::unique_ptr<CudaMemory> memory_;
};

}  // namespace

int CudaDeviceCount() { return cuda::DeviceCount(); }

absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(int ordinal, size_t budget_bytes) {
  const int count = cuda::DeviceCount();
  if (ordinal < 0 || ordinal >= count) {
    return absl::UnavailableError(absl::StrCat("cuda device ", ordinal, " not visible (", count,
                                               " device(s); ", cuda::NoDeviceReason(), ")"));
  }
  HMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  if (budget_bytes == 0) {
    size_t free_bytes = 0, total_bytes = 0;
    HMOE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    budget_bytes = free_bytes;
  }
  return std::unique_ptr<Device>(new CudaDevice(ordinal, budget_bytes));
}

}  // namespace hmoe

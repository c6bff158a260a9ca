#pragma once

// The device abstraction (docs/architecture.md "Libraries", docs/style.md §7): memory with a
// budget, streams, events, asynchronous copies, and the small closed set of compute ops the model
// forward needs. The forward pass (common/engine) is written once against this interface; CpuDevice
// (always available) and CudaDevice (built with the CUDA option) implement it.
//
// This header includes no CUDA headers. Pointers named "device pointer" below point into memory
// the device can read directly: a DeviceBuffer of this device, or, for a device whose
// host_accessible() is true (CpuDevice), any host memory (e.g. weightd's read-only mapping).
//
// Execution model. Every copy and op is enqueued on a Stream and runs in stream order; work on
// different streams may run concurrently and is ordered only through Events. Arguments that are
// host pointers (copy sources/destinations, the host-side metadata of the MLA ops) must stay valid
// until the stream has executed the call (Stream::Synchronize, or an Event recorded after it).
// The CpuDevice executes every call synchronously in the calling thread before returning (its
// streams are in-order by construction; events are complete as soon as they are recorded), so on a
// CPU "enqueued" means "done".
//
// Threading. A Device may be driven from several threads as long as each Stream is used by one
// thread at a time (the dual-batch decode drives two streams from two threads; SLP's loader,
// model and unloader threads each own a stream). Memory accounting and event methods are
// thread-safe.
//
// Numerics (the contract every implementation follows; device tests check it against scalar
// references): activations are F32 in memory. Linear() with FP8 or BF16 weights rounds each
// activation to BF16 (round to nearest even) and accumulates in F32 (FP8: each 128-column block
// of a row summed, then scaled by its block's scale_inv); with F32 weights it is plain F32.
// One exception, chosen for speed: a CudaDevice's FP8 Linear() of more than 16 tokens rounds each
// scaled weight (code * scale_inv) to BF16 by default (CudaFp8Linear::kBf16), which adds at most
// 2^-9 * sum_c |W[r][c] x[c]| to an output; CudaFp8Linear::kBlocks keeps the block structure.
// Everything else (norms, RoPE, softmax, router) is F32 math.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "common/kernels/op_params.h"
#include "common/model/dtype.h"

namespace hmoe {

class Device;

enum class DeviceKind { kCpu, kCuda };

// "cpu" or "cuda".
const char* DeviceKindName(DeviceKind kind);

// ---------------------------------------------------------------------------------- memory

// Memory owned by one Device, released through that device's deleter when destroyed (which also
// returns the bytes to the device's budget and wakes AllocateBlocking callers). Move-only. A
// DeviceBuffer must not outlive the Device that allocated it.
class DeviceBuffer {
 public:
  // Called once with (context, data, size_bytes) when the buffer is destroyed.
  using Deleter = void (*)(void* context, void* data, size_t size_bytes);

  DeviceBuffer() = default;
  DeviceBuffer(void* data, size_t size_bytes, Deleter deleter, void* context)
      : data_(data), size_bytes_(size_bytes), deleter_(deleter), context_(context) {}
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Device pointer to the first byte (64-byte aligned at least); null for an empty buffer.
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size_bytes() const { return size_bytes_; }
  bool empty() const { return data_ == nullptr; }
  // Frees the memory now (no-op when empty).
  void Reset();

 private:
  void* data_ = nullptr;
  size_t size_bytes_ = 0;
  Deleter deleter_ = nullptr;
  void* context_ = nullptr;
};

// ---------------------------------------------------------------------------------- streams,
// events

class Event;

// An in-order queue of device work. Created by Device::CreateStream; must not outlive its device.
// Used by one thread at a time.
class Stream {
 public:
  virtual ~Stream() = default;
  // Blocks the calling thread until all work enqueued so far has finished. Internal on a device
  // error (for CUDA: a sticky error; the worker should exit).
  virtual absl::Status Synchronize() = 0;
  // Work enqueued on this stream after this call waits until `event` has completed (the event's
  // last Record). Does not block the host. An event never recorded counts as complete.
  virtual absl::Status WaitEvent(Event& event) = 0;
};

// A marker in a stream. Created by Device::CreateEvent; must not outlive its device. Record and
// Synchronize may be called from different threads, but not concurrently with each other on the
// same event (EventTuple orders them through its host event).
class Event {
 public:
  virtual ~Event() = default;
  // Captures the work enqueued on `stream` so far: the event completes when that work has.
  virtual absl::Status Record(Stream& stream) = 0;
  // Blocks the host until the last Record has completed (immediately if never recorded).
  virtual absl::Status Synchronize() = 0;
  // True when the last Record has completed (or there was none). Does not block.
  virtual bool IsComplete() = 0;
};

// A resettable host-side notification (a manual-reset event): Set wakes every waiter and stays
// set until Reset. Thread-safe.
class HostEvent {
 public:
  HostEvent();
  ~HostEvent();
  HostEvent(const HostEvent&) = delete;
  HostEvent& operator=(const HostEvent&) = delete;

  void Set();
  void Reset();
  bool IsSet() const;
  // Blocks until set; DeadlineExceeded (naming `what`, if given) at `deadline`.
  absl::Status Wait(absl::Time deadline = absl::InfiniteFuture(), const char* what = nullptr);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The paper's event tuple (§3.1): a device event paired with a host event. The producer (e.g.
// SLP's loader) enqueues work on its stream and calls Signal(stream): the device event is recorded
// after that work, then the host event is set, so a consumer that sees the host event knows the
// device event is recorded and can order its own stream after it without blocking on the device.
// Reset() re-arms the tuple for the next use (e.g. the next prompt). Thread-safe between one
// producer and any number of consumers; Reset must not race with Signal.
class EventTuple {
 public:
  // Creates the device event on `device`. The tuple must not outlive the device.
  static absl::StatusOr<std::unique_ptr<EventTuple>> Create(Device& device);
  ~EventTuple();

  // Records the device event on `stream`, then sets the host event.
  absl::Status Signal(Stream& stream);
  // Host-waits for the host event (DeadlineExceeded at `deadline`), then makes `stream` wait for
  // the device event (no host blocking on the device work itself).
  absl::Status Wait(Stream& stream, absl::Time deadline = absl::InfiniteFuture());
  // Host-waits for the host event, then blocks until the device work before the event has
  // completed (an unloader freeing memory needs this).
  absl::Status WaitHost(absl::Time deadline = absl::InfiniteFuture());
  // Clears the host event.
  void Reset();
  bool IsSet() const;

  HostEvent& host_event() { return host_; }
  Event& device_event() { return *device_; }

 private:
  explicit EventTuple(std::unique_ptr<Event> device);
  std::unique_ptr<Event> device_;
  HostEvent host_;
};

// ---------------------------------------------------------------------------------- weight views

// A linear layer's weight W [rows, cols] (PyTorch [out, in] layout) in device-readable memory.
// Not owning. dtype is kF8E4M3 (with block scales), kBF16 or kF32. Element (r, c) is at
// data + (r * row_stride + c) * DTypeSize(dtype); `data` may be unaligned for BF16/FP8 (checkpoint
// tensors are), must be 4-byte aligned for F32.
struct LinearWeight {
  DType dtype = DType::kF32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // elements between rows, >= cols
  // FP8 only: F32 scale of block (i, j) at scale_inv[i * scale_stride + j], blocks of 128x128
  // (multiply to dequantize). 4-byte aligned.
  const float* scale_inv = nullptr;
  int64_t scale_stride = 0;

  bool empty() const { return data == nullptr; }
};

// A 1-D weight (norm weight, router bias): `size` elements of kBF16, kF16 or kF32 in
// device-readable memory (any alignment). Empty (data null, size 0) means "none".
struct VectorWeight {
  DType dtype = DType::kF32;
  const void* data = nullptr;
  int64_t size = 0;

  bool empty() const { return data == nullptr; }
};

// ---------------------------------------------------------------------------------- op arguments

// One layer of a paged MLA latent cache in device memory. Token slot s (= block * block_size +
// offset within the block) of the layer holds row_floats F32: the normalized latent
// (kv_lora_rank) followed by the rotated rope key (rope_dim), at
//   base + (s / block_size) * block_stride + (s % block_size) * row_floats.
struct KvLayerView {
  float* base = nullptr;
  int64_t block_size = 0;    // tokens per block
  int64_t block_stride = 0;  // floats between consecutive blocks of this layer
  int64_t row_floats = 0;    // kv_lora_rank + rope_dim
};

// The queries of one sequence in an MLA call: rows [query_begin, query_begin + num_queries) of q
// and out, at absolute positions start_pos .. start_pos + num_queries - 1. The cache already holds
// that sequence's keys 0 .. start_pos + num_queries - 1 (the new tokens' included); query i sees
// keys 0 .. start_pos + i (causal). The sequence's block table is block_tables[block_table_offset
// .. + ceil((start_pos + num_queries) / block_size)).
struct MlaSegment {
  int64_t query_begin = 0;
  int64_t num_queries = 0;
  int64_t start_pos = 0;
  int64_t block_table_offset = 0;
};

// The keys a segment's queries see in MlaAttentionPartial (context parallelism, DSLP): positions
// [begin, end) of the segment's sequence, further limited by causality (query i sees keys up to
// start_pos + i).
struct MlaKeyRange {
  int64_t begin = 0;
  int64_t end = 0;
};

// Weight-absorbed MLA attention (MODEL-SPEC §3.7) of a batch of query rows against the paged
// latent cache of one layer:
//   q~_h = W_UK_h^T q_nope_h,  score(s) = softmax_scale * (q~_h . c_s + q_pe_h . k_pe_s),
//   u_h = sum_s softmax(score)_s c_s,  out_h = W_UV_h u_h.
struct MlaAttentionArgs {
  MlaDimensions dims;
  // Device pointer: row t, head h: q_nope at q + t * q_stride + h * (dn + dr), followed by the
  // already rotated q_pe (the q_b_proj output layout).
  const float* q = nullptr;
  int64_t q_stride = 0;
  // Host array of num_heads weights: W_UK_h^T [kv_lora_rank, nope_dim] per head (prepared at load,
  // see common/engine/weights.h).
  std::span<const LinearWeight> w_uk_t;
  // kv_b_proj [nh * (dn + dv), kv_lora_rank]; W_UV_h is rows h * (dn + dv) + dn .. + dv.
  LinearWeight kv_b;
  KvLayerView cache;
  // Device pointer: the concatenated block tables of the segments.
  const int32_t* block_tables = nullptr;
  // Host array: the sequences of this call; their query rows must not overlap.
  std::span<const MlaSegment> segments;
  // Device pointer: row t, head h at out + t * out_stride + h * dv.
  float* out = nullptr;
  int64_t out_stride = 0;
  // MlaAttentionPartial only (host array): one key range per segment. The other ops ignore it.
  std::span<const MlaKeyRange> key_ranges;
};

// The running result of context-parallel attention (DSLP's ring pass-KV, paper §3.2) for query
// rows whose keys arrive in several parts: per query row t (the row of q) and head h, the
// softmax-weighted average of the latent of the keys seen so far,
//   u[(t * num_heads + h) * kv_lora_rank ..+ kv_lora_rank],
// and the natural log of the sum of exp(score) over those keys,
//   lse[t * num_heads + h]   (-infinity: no key yet; u is then 0).
// Merging the attention (u', lse') over further keys gives the attention over the union:
//   lse'' = log(e^lse + e^lse'),  u'' = (e^lse u + e^lse' u') / e^lse''.
struct MlaPartialState {
  float* u = nullptr;    // device pointer
  float* lse = nullptr;  // device pointer
  // The call overwrites the state of its rows instead of merging into it (their first part).
  bool first = false;
};

// ---------------------------------------------------------------------------------- Device

class Device {
 public:
  virtual ~Device() = default;

  virtual DeviceKind kind() const = 0;
  // "cpu", "cuda:0", ...
  virtual std::string name() const = 0;
  // True when device memory is ordinary host memory (CpuDevice): host pointers are device
  // pointers and copies are memcpy.
  virtual bool host_accessible() const = 0;

  // --- memory. All thread-safe.

  // Allocates `size_bytes` (> 0) of device memory, 64-byte aligned, NOT initialized.
  // ResourceExhausted when bytes_in_use() + size_bytes would exceed budget_bytes() (or the device
  // is out of memory); InvalidArgument for size 0.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t size_bytes) = 0;
  // As Allocate, but waits for other buffers to be freed while the request does not fit, until
  // `deadline` (DeadlineExceeded). A request that can never fit (size_bytes > budget_bytes())
  // fails at once with ResourceExhausted. Waiters are served in FIFO order (a large request is
  // not starved by small ones).
  virtual absl::StatusOr<DeviceBuffer> AllocateBlocking(size_t size_bytes, absl::Time deadline) = 0;
  virtual size_t bytes_in_use() const = 0;
  // Highest bytes_in_use() since creation or the last ResetPeakBytes().
  virtual size_t peak_bytes_in_use() const = 0;
  virtual void ResetPeakBytes() = 0;
  // The allocation budget; SIZE_MAX when unlimited.
  virtual size_t budget_bytes() const = 0;

  // --- streams and events.

  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream() = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;
  // Waits for all work on all streams of this device.
  virtual absl::Status Synchronize() = 0;

  // --- copies, enqueued on `stream`. Host pointers may be any host memory (CUDA: pageable memory
  // makes the copy synchronous w.r.t. the host; pinned or cudaHostRegister'ed memory is
  // asynchronous).

  virtual absl::Status CopyToDevice(Stream& stream, void* device_dst, const void* host_src,
                                    size_t bytes) = 0;
  virtual absl::Status CopyToHost(Stream& stream, void* host_dst, const void* device_src,
                                  size_t bytes) = 0;
  virtual absl::Status CopyOnDevice(Stream& stream, void* device_dst, const void* device_src,
                                    size_t bytes) = 0;
  virtual absl::Status Memset(Stream& stream, void* device_dst, int value, size_t bytes) = 0;

  // --- compute ops, enqueued on `stream`. All pointers are device pointers unless noted.
  // Row-major activations with explicit row strides (in elements). Size/shape errors are
  // InvalidArgument; outputs must not alias inputs unless stated.

  // y[t * y_stride + r] = sum_c W[r][c] * x[t * x_stride + c], t < n, r < w.rows (see the numerics
  // note at the top: BF16-rounded activations for FP8/BF16 weights).
  virtual absl::Status Linear(Stream& stream, const LinearWeight& w, const float* x,
                              int64_t x_stride, int64_t n, float* y, int64_t y_stride) = 0;

  // y[t, i] = weight[i] * x[t, i] / sqrt(mean_i(x[t, i]^2) + eps) for i < dim. `y` may alias `x`
  // (same stride).
  virtual absl::Status RmsNorm(Stream& stream, const float* x, int64_t x_stride, int64_t n,
                               int64_t dim, const VectorWeight& weight, float eps, float* y,
                               int64_t y_stride) = 0;

  // In-place interleaved RoPE (ApplyRopeInterleaved of common/engine/reference/reference_ops.h)
  // on x + t * x_stride + h * head_stride, rope_dim values, for t < n and h < num_heads, at
  // position positions[t] (device int32[n]) with inv_freq (device F32[rope_dim / 2]).
  // CpuDevice computes angles in double (as the reference); a GPU may use F32 sincos of a
  // range-reduced angle.
  virtual absl::Status RopeInterleaved(Stream& stream, float* x, int64_t x_stride, int64_t n,
                                       int64_t num_heads, int64_t head_stride, int64_t rope_dim,
                                       const int32_t* positions, const float* inv_freq,
                                       float attention_factor) = 0;

  // out[i] = SiLU(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], i < count. `out` may
  // alias `gate` or `up`.
  virtual absl::Status SiluMul(Stream& stream, const float* gate, const float* up, int64_t count,
                               float* out) = 0;

  // out[i] = a[i] + b[i], i < count. `out` may alias `a` or `b`.
  virtual absl::Status Add(Stream& stream, const float* a, const float* b, int64_t count,
                           float* out) = 0;

  // out[t * table.cols + c] = table[ids[t]][c] as F32, t < n. `table` is BF16 or F32 (no scales).
  // ids (device int32[n]) must be in [0, table.rows) (checked on the CPU; undefined on a GPU).
  virtual absl::Status EmbeddingGather(Stream& stream, const LinearWeight& table,
                                       const int32_t* ids, int64_t n, float* out) = 0;

  // The router of a MoE layer for n tokens: logits = router x (F32 math, no BF16 rounding: routing
  // decisions are discrete and must track the reference), then noaux_tc selection with
  // `bias` (F32 [E] or empty) as reference::MoeGate. Writes ids[t * K + j] and weights[t * K + j]
  // (selected experts in descending biased score, ties to the lower id; weights normalized and
  // scaled by routed_scaling_factor).
  virtual absl::Status MoeGate(Stream& stream, const float* x, int64_t x_stride, int64_t n,
                               const LinearWeight& router, const VectorWeight& bias,
                               const MoeGateParams& params, int32_t* ids, float* weights) = 0;

  // Writes n tokens into a paged latent cache layer: slot slots[t] (device int32[n]; see
  // KvLayerView) receives latent[t * latent_stride ..+ kv_lora_rank] then
  // k_pe[t * k_pe_stride ..+ rope_dim], with kv_lora_rank + rope_dim == cache.row_floats.
  virtual absl::Status KvCacheWrite(Stream& stream, const KvLayerView& cache, const int32_t* slots,
                                    int64_t n, const float* latent, int64_t latent_stride,
                                    const float* k_pe, int64_t k_pe_stride,
                                    int64_t kv_lora_rank) = 0;

  // MLA attention for decode: segments with few queries each (typically one token per sequence),
  // many sequences. Result as MlaPrefillAttention up to F32 rounding.
  virtual absl::Status MlaDecodeAttention(Stream& stream, const MlaAttentionArgs& args) = 0;

  // MLA attention for prefill chunks: segments with many queries. Tiled (flash-style online
  // softmax over key tiles): memory use is independent of the square of the sequence length.
  virtual absl::Status MlaPrefillAttention(Stream& stream, const MlaAttentionArgs& args) = 0;

  // Context-parallel MLA (DSLP): as MlaPrefillAttention for args.segments, but segment s's queries
  // see only the keys of args.key_ranges[s] (and causality), and instead of projecting through
  // W_UV the attention over those keys is merged into `state` (see MlaPartialState; args.kv_b,
  // out and out_stride are not used). Rows that see no key of this call keep their state (with
  // state.first: get u = 0, lse = -inf). The keys must be in the cache (block tables as for the
  // other MLA ops). InvalidArgument when key_ranges.size() != segments.size().
  virtual absl::Status MlaAttentionPartial(Stream& stream, const MlaAttentionArgs& args,
                                           const MlaPartialState& state) = 0;

  // The output projection of MLA for n rows of latent attention results (MlaPartialState::u
  // layout): out[t * out_stride + h * v_dim + i] = (W_UV_h u[t, h])[i], W_UV_h = rows
  // h * (nope_dim + v_dim) + nope_dim .. + v_dim of kv_b, with the Linear numerics (u rounded to
  // BF16 for FP8/BF16 kv_b). CpuDevice: the same bits as the projection inside its
  // MlaPrefillAttention on the same u.
  virtual absl::Status MlaProjectLatent(Stream& stream, const MlaDimensions& dims,
                                        const LinearWeight& kv_b, const float* u, int64_t n,
                                        float* out, int64_t out_stride) = 0;

  // dst[i * dst_stride + c] = src[rows[i] * src_stride + c] for i < n, c < cols (rows: device
  // int32[n]).
  virtual absl::Status GatherRows(Stream& stream, const float* src, int64_t src_stride,
                                  const int32_t* rows, int64_t n, int64_t cols, float* dst,
                                  int64_t dst_stride) = 0;

  // dst[rows[i] * dst_stride + c] += weights[i] * src[i * src_stride + c] for i < n, c < cols, in
  // increasing i for each destination element (deterministic). rows/weights: device int32[n] /
  // F32[n]; rows may repeat.
  virtual absl::Status ScatterAddRows(Stream& stream, const float* src, int64_t src_stride,
                                      const int32_t* rows, const float* weights, int64_t n,
                                      int64_t cols, float* dst, int64_t dst_stride) = 0;
};

// Number of visible CUDA devices; 0 when built without CUDA or without a GPU/driver.
int CudaDeviceCount();

// How a CudaDevice computes Linear() with FP8 weights for more than 16 tokens (prefill; decode
// calls always keep the block structure):
enum class CudaFp8Linear {
  // HMOE_CUDA_FP8_LINEAR from the environment: "bf16" or "blocks"; kBf16 when unset or empty.
  kFromEnvironment,
  // Each weight's code times its block scale rounded to BF16 (relative error <= 2^-9 per weight,
  // the size of the activations' own rounding), then one tensor-core BF16 GEMM over all columns
  // with F32 accumulation: the fast path.
  kBf16,
  // The numerics note's block structure exactly (one BF16 GEMM per 128-column block into F32
  // partial sums, each scaled by its block scale): slower, memory-bound on the partials.
  kBlocks,
};

struct CudaDeviceOptions {
  size_t budget_bytes = 0;  // 0: the GPU's free memory at creation
  CudaFp8Linear fp8_linear = CudaFp8Linear::kFromEnvironment;
};

// A CudaDevice on GPU `ordinal` with an optional memory budget (0: the GPU's free memory at
// creation). Unavailable when built without CUDA (HMOE_WITH_CUDA off) or the GPU is not visible;
// InvalidArgument naming the value for a bad HMOE_CUDA_FP8_LINEAR.
absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(int ordinal, size_t budget_bytes = 0);
absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(int ordinal,
                                                      const CudaDeviceOptions& options);

}  // namespace hmoe

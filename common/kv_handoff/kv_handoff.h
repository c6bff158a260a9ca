#pragma once

// KV-cache hand-off between a prefill worker and the decode worker (docs/architecture.md "A
// request's path", step 4). The prefill worker writes one sequence's latent KV cache into an
// exportable buffer, returns a handle (a shared-memory name on the CPU, a CUDA IPC memory handle on
// a GPU) plus the first token; the router admits the request to the decode worker with that handle;
// the decode worker opens it, validates the header, copies the payload into its paged pool
// (KvCache::Import) and acknowledges (hmoe.decode.v1.KvImported); the prefill worker then frees
// the buffer (KvHandoffSegment::Remove).
//
// Buffer format (layout version kKvHandoffLayoutVersion): a KvHandoffHeader of header_bytes
// bytes, then payload_bytes of payload in KvCache's hand-off format (kv_cache.h Export/Import:
// for each layer, for each token, the normalized latent (kv_lora_rank) then the rotated rope key
// (rope_dim), F32). All integers little-endian (the only byte order we run on).
//
// The CPU form is a POSIX shared-memory object (/dev/shm/<name>), created 0600 by the prefill
// worker's user; the decode worker maps it read-only and refuses objects of another user or with
// group/other permissions (another user could otherwise feed it a forged cache).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hmoe {

inline constexpr uint64_t kKvHandoffMagic = 0x3130564b454f4d48ull;  // "HMOEKV01" in memory order
// What an exporter writes over the magic of a device (CUDA IPC) buffer just before it frees it:
// the CUDA driver may still open the handle of a freed buffer (its memory is not returned at
// once, or another allocation took it), so an importer must not trust the handle alone
// (cuda_ipc_import.h). "HMOEKVFR".
inline constexpr uint64_t kKvHandoffFreedMagic = 0x5246564b454f4d48ull;
inline constexpr uint32_t kKvHandoffHeaderVersion = 1;
inline constexpr uint32_t kKvHandoffLayoutVersion = 1;
// Element type codes of the payload (only F32 today).
inline constexpr uint32_t kKvHandoffDTypeF32 = 3;  // = DType::kF32

// The cache shape both sides must agree on.
struct KvHandoffShape {
  uint32_t num_layers = 0;
  uint32_t kv_lora_rank = 0;
  uint32_t rope_dim = 0;
  uint32_t dtype = kKvHandoffDTypeF32;
  uint32_t layout_version = kKvHandoffLayoutVersion;

  // Payload bytes for `num_tokens` tokens.
  uint64_t PayloadBytes(int64_t num_tokens) const;
  bool operator==(const KvHandoffShape&) const = default;
};

// The first bytes of a hand-off buffer. POD, 64 bytes.
struct KvHandoffHeader {
  uint64_t magic = kKvHandoffMagic;
  uint32_t header_version = kKvHandoffHeaderVersion;
  uint32_t layout_version = kKvHandoffLayoutVersion;
  uint32_t num_layers = 0;
  uint32_t kv_lora_rank = 0;
  uint32_t rope_dim = 0;
  uint32_t dtype = kKvHandoffDTypeF32;
  uint64_t num_tokens = 0;
  uint64_t header_bytes = 64;  // offset of the payload
  uint64_t payload_bytes = 0;
  uint64_t reserved = 0;

  KvHandoffShape shape() const {
    return {num_layers, kv_lora_rank, rope_dim, dtype, layout_version};
  }
};
static_assert(sizeof(KvHandoffHeader) == 64);

// A header for `num_tokens` tokens of `shape`.
KvHandoffHeader MakeKvHandoffHeader(const KvHandoffShape& shape, int64_t num_tokens);

// Checks `header` against what the importer expects: magic, header version, layout version,
// shape and token count, and that the payload size matches the shape (and fits `buffer_bytes`,
// the size of the whole buffer). InvalidArgument naming the first mismatching field
// ("kv hand-off header: kv_lora_rank 64, expected 512").
absl::Status ValidateKvHandoffHeader(const KvHandoffHeader& header, const KvHandoffShape& expected,
                                     int64_t expected_num_tokens, uint64_t buffer_bytes);

// Hand-off shared-memory names match [A-Za-z0-9_.-]{1,200} (no slash; "/" is prepended for
// shm_open). InvalidArgument otherwise.
absl::Status ValidateKvHandoffName(std::string_view name);

// The producer's side of a CPU hand-off: a new shared-memory object holding a header and room for
// the payload, mapped read-write. Move-only; the destructor unmaps but does not remove the name
// (the consumer may still open it); Remove() does. Thread-compatible.
class KvHandoffSegment {
 public:
  // Creates /dev/shm/<name> (0600) sized for `num_tokens` tokens of `shape` and writes the header.
  // AlreadyExists when the name is taken; InvalidArgument for a bad name or num_tokens < 1.
  static absl::StatusOr<KvHandoffSegment> Create(std::string_view name, const KvHandoffShape& shape,
                                                 int64_t num_tokens);
  // Unlinks the name (existing mappings stay valid). NotFound when it does not exist.
  static absl::Status Remove(std::string_view name);

  KvHandoffSegment(KvHandoffSegment&& other) noexcept;
  KvHandoffSegment& operator=(KvHandoffSegment&& other) noexcept;
  KvHandoffSegment(const KvHandoffSegment&) = delete;
  KvHandoffSegment& operator=(const KvHandoffSegment&) = delete;
  ~KvHandoffSegment();

  const std::string& name() const { return name_; }
  const KvHandoffHeader& header() const;
  // Where the producer writes the payload (KvCache::Export with MemorySpace::kHost).
  std::span<std::byte> payload();

 private:
  KvHandoffSegment(std::string name, void* base, size_t size_bytes)
      : name_(std::move(name)), base_(base), size_bytes_(size_bytes) {}
  void Unmap();

  std::string name_;
  void* base_ = nullptr;
  size_t size_bytes_ = 0;
};

// Bytes of a CUDA IPC memory handle (cudaIpcMemHandle_t).
inline constexpr size_t kKvCudaIpcHandleBytes = 64;

// Where a hand-off buffer lives (the proto's KvHandle).
struct KvHandleSpec {
  enum class Kind { kShm, kCudaIpc };
  Kind kind = Kind::kShm;
  std::string shm_name;         // kShm
  std::string cuda_ipc_handle;  // kCudaIpc: the raw cudaIpcMemHandle_t bytes
  // kCudaIpc: the PCI bus id of the GPU holding the buffer ("0000:65:00.0"), which names it in
  // every process (CUDA ordinals depend on each process's CUDA_VISIBLE_DEVICES).
  std::string cuda_device;
  int64_t num_tokens = 0;       // what the caller says the buffer holds
  uint32_t layout_version = 0;  // what the caller says the layout is
};

// The checks that need no buffer: num_tokens >= 1, layout_version == expected.layout_version,
// and for kShm a valid name (ValidateKvHandoffName), for kCudaIpc a handle of
// kKvCudaIpcHandleBytes bytes and a PCI bus id of [0-9A-Fa-f:.]{1,64}. InvalidArgument naming the
// kv_handle field otherwise.
absl::Status ValidateKvHandleSpec(const KvHandleSpec& handle, const KvHandoffShape& expected);

// An opened, validated hand-off buffer. The payload stays readable until the object is
// destroyed. Thread-compatible.
class KvImportSource {
 public:
  virtual ~KvImportSource() = default;
  virtual const KvHandoffHeader& header() const = 0;
  // The payload; host memory when payload_on_device() is false, else a device pointer of the
  // importing device.
  virtual std::span<const std::byte> payload() const = 0;
  virtual bool payload_on_device() const = 0;
  // A name for logs ("shm:hmoe-kv-12").
  virtual std::string description() const = 0;
};

// Opens hand-off buffers for the decode worker. Thread-safe.
//
// The caller must destroy the source before acknowledging the import: on the acknowledgement the
// prefill worker frees the buffer, and a CUDA IPC mapping must be closed before its memory is
// freed (cudaIpcCloseMemHandle before the exporter's cudaFree).
class KvImporter {
 public:
  virtual ~KvImporter() = default;
  // Opens `handle` and validates its header against `expected` and handle.num_tokens. Errors:
  // InvalidArgument (bad name or handle bytes, header/shape/layout mismatch, truncated buffer),
  // NotFound (no such segment; a CUDA IPC handle whose exporter exited or freed the buffer),
  // PermissionDenied (a segment owned by another user or accessible to group/others),
  // FailedPrecondition (the GPU holding a CUDA IPC buffer is not visible to this process, or
  // cannot be mapped), Unavailable (a CUDA IPC handle on a build or machine without CUDA, or on an
  // importer built for shared memory only).
  virtual absl::StatusOr<std::unique_ptr<KvImportSource>> Open(const KvHandleSpec& handle,
                                                               const KvHandoffShape& expected) = 0;
};

// The CPU implementation: shared-memory segments (CUDA IPC handles are Unavailable).
std::unique_ptr<KvImporter> NewShmKvImporter();

// Where the decode worker imports to: the GPU its attention and KV pool run on, or host memory.
struct KvImportTarget {
  int cuda_device = -1;  // CUDA ordinal in this process; -1: host memory (CPU attention)
};

// Every hand-off kind: shared-memory segments, and CUDA IPC handles
// (common/kv_handoff/cuda_ipc_import.h: the payload stays on the GPU when `target` is the buffer's
// GPU or a peer of it, else it is copied to host memory; Unavailable on a build or machine without
// CUDA).
std::unique_ptr<KvImporter> NewKvImporter(const KvImportTarget& target);

}  // namespace hmoe

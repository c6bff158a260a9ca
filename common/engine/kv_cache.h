#pragma once

// The paged MLA KV cache (MODEL-SPEC §3.7): for every layer and token, the normalized latent c
// (kv_lora_rank F32) and the rotated rope key k_pe (qk_rope_head_dim F32), in blocks of
// block_size tokens allocated from one pool in device memory. A sequence owns a block table (the
// pool blocks holding its tokens 0, block_size, 2 * block_size, ...); blocks are shared by all
// layers (block b of layer l is at layer l's region, index b).
//
// Device memory layout (one DeviceBuffer, F32): layer-major,
//   [layer][block][offset in block][kv_lora_rank + rope_dim]
// i.e. KvLayerView{base = data + layer * num_blocks * block_size * row_floats,
//                  block_stride = block_size * row_floats, row_floats = kv_lora_rank + rope_dim}.
//
// Blocks are reference-counted so sequences can share a prefix (common/engine/prefix_cache.h): a
// block returns to the pool when its last holder (a sequence or the prefix cache) lets it go. A
// shared block is always one whose tokens are all written (a full block of a finished prefix, or
// a partial block of a finished sequence that only the prefix cache holds): a sequence appends
// only to blocks it alone holds, so shared rows never change.
//
// Hand-off format (Export/Import; prefill worker -> decode worker): a flat, contiguous byte
// buffer of ExportBytes(n) = num_layers * n * (kv_lora_rank + rope_dim) * 4 bytes, little-endian
// F32, layer-major then token-major:
//   for layer in 0..num_layers-1: for token in 0..n-1: latent[kv_lora_rank], k_pe[rope_dim]
// No header: the number of tokens and the model's dimensions travel with the hand-off message
// (both sides hold the same ModelConfig). Independent of the block size, so caches with
// different block sizes exchange sequences freely.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/device/device.h"
#include "common/model/model_config.h"

namespace hmoe {

struct KvCacheConfig {
  int64_t num_layers = 0;
  int64_t kv_lora_rank = 0;
  int64_t rope_dim = 0;
  int64_t block_size = 64;  // tokens per block
  int64_t num_blocks = 0;   // blocks in the pool

  int64_t row_floats() const { return kv_lora_rank + rope_dim; }
  // Bytes of device memory the pool takes.
  size_t pool_bytes() const {
    return static_cast<size_t>(num_layers * num_blocks * block_size * row_floats()) * sizeof(float);
  }
  // The dimensions of `model` (num_hidden_layers, kv_lora_rank, qk_rope_head_dim).
  static KvCacheConfig ForModel(const ModelConfig& model, int64_t num_blocks,
                                int64_t block_size = 64);
};

// Where the other side of an Export/Import lives.
enum class MemorySpace { kHost, kDevice };

class KvCache;

// One sequence's block table and length. Created by KvCache::NewSequence; move-only; returns its
// blocks to the pool when destroyed or Reset. Must not outlive its cache. Not thread-safe: one
// user at a time (the engine step that runs it).
class KvSequence {
 public:
  KvSequence() = default;
  ~KvSequence();
  KvSequence(KvSequence&& other) noexcept;
  KvSequence& operator=(KvSequence&& other) noexcept;
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;

  KvCache* cache() const { return cache_; }
  // Tokens whose KV is in the cache (the position of the next token).
  int64_t num_tokens() const { return num_tokens_; }
  // Tokens the reserved blocks can hold.
  int64_t capacity_tokens() const;
  // Pool block indices, in token order.
  const std::vector<int32_t>& block_table() const { return blocks_; }

  // Grows the block table so it holds at least `total_tokens` tokens. All or nothing:
  // ResourceExhausted (naming the free and needed block counts) when the pool has too few free
  // blocks; the sequence is unchanged then. Never shrinks.
  absl::Status Reserve(int64_t total_tokens);
  // Returns the blocks not needed to hold max(total_tokens, num_tokens()) tokens to the pool
  // (undoes a Reserve that turned out not to be needed).
  void Shrink(int64_t total_tokens);
  // Declares tokens 0 .. num_tokens - 1 valid (the engine calls it after writing them).
  // num_tokens must be <= capacity_tokens() (checked).
  void SetNumTokens(int64_t num_tokens);
  // Returns every block to the pool; the sequence becomes empty (still bound to its cache).
  void Reset();
  // Makes the empty sequence start with `blocks`, already written, holding `num_tokens` tokens
  // (<= blocks.size() * block_size), taking a reference on each (the caller keeps its own).
  // Every block but the last must be full, and the last must be full too or held by nobody else:
  // the sequence will append into it. FailedPrecondition when the sequence is not empty.
  absl::Status AdoptBlocks(const std::vector<int32_t>& blocks, int64_t num_tokens);

 private:
  friend class KvCache;
  explicit KvSequence(KvCache* cache) : cache_(cache) {}

  KvCache* cache_ = nullptr;
  std::vector<int32_t> blocks_;
  int64_t num_tokens_ = 0;
};

// The block pool. Block allocation and accounting are thread-safe; the cache memory itself is
// written by device ops of whoever runs a sequence.
class KvCache {
 public:
  // Allocates config.pool_bytes() from `device` (which must outlive the cache). InvalidArgument
  // for non-positive dimensions; the device's ResourceExhausted when it does not fit.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(Device& device,
                                                         const KvCacheConfig& config);
  ~KvCache();

  const KvCacheConfig& config() const { return config_; }
  Device& device() const { return *device_; }
  int64_t num_free_blocks() const;
  int64_t num_blocks() const { return config_.num_blocks; }

  // An empty sequence of this cache.
  KvSequence NewSequence() { return KvSequence(this); }

  // Block references for holders other than sequences (the prefix cache). AllocateBlock takes one
  // free block with one reference (ResourceExhausted when none is free); Retain adds a reference
  // to held blocks; Release drops one, and a block whose last reference goes returns to the pool.
  absl::StatusOr<int32_t> AllocateBlock();
  void Retain(const std::vector<int32_t>& blocks);
  void Release(const std::vector<int32_t>& blocks);
  // References on `block` (0 when free).
  int32_t block_refs(int32_t block) const;
  // Copies rows [0, rows) of every layer from block `src` to block `dst`, enqueued on `stream`.
  absl::Status CopyBlockRows(int32_t src, int32_t dst, int64_t rows, Stream& stream);

  // The device view of `layer` (0 <= layer < num_layers).
  KvLayerView layer_view(int64_t layer) const;

  // Bytes of the hand-off format for `num_tokens` tokens.
  size_t ExportBytes(int64_t num_tokens) const;
  // Writes all num_tokens() tokens of `seq` in the hand-off format to `dst` (ExportBytes bytes,
  // host or device memory per `dst_space`), enqueued on `stream` (synchronize before reading).
  // InvalidArgument when `seq` belongs to another cache.
  absl::Status Export(const KvSequence& seq, Stream& stream, void* dst, MemorySpace dst_space);
  // As Export, for the first `num_tokens` tokens held by `blocks` (in token order; enough of them
  // to hold num_tokens) — blocks the caller holds references on (KvCache::Retain) and nobody
  // writes meanwhile, such as a prefix cache's. InvalidArgument for too few blocks, a block index
  // outside the pool or a null destination.
  absl::Status ExportBlocks(const std::vector<int32_t>& blocks, int64_t num_tokens, Stream& stream,
                            void* dst, MemorySpace dst_space);
  // Fills the empty sequence `seq` of this cache with `num_tokens` tokens read from `src` in the
  // hand-off format (ExportBytes(num_tokens) bytes), reserving its blocks first
  // (ResourceExhausted when they do not fit; `seq` unchanged). FailedPrecondition when `seq` is
  // not empty; InvalidArgument when it belongs to another cache.
  absl::Status Import(KvSequence& seq, int64_t num_tokens, Stream& stream, const void* src,
                      MemorySpace src_space);
  // As Import, but `seq` already holds its first seq.num_tokens() tokens (a cached prefix it
  // shares, KvSequence::AdoptBlocks): only tokens seq.num_tokens() .. num_tokens - 1 are read from
  // `src`, which holds all num_tokens tokens in the hand-off format. ResourceExhausted when the
  // blocks do not fit (`seq` unchanged); InvalidArgument when seq holds num_tokens or more; after
  // a failed copy `seq` holds its prefix and the reserved blocks (discard it).
  absl::Status ImportSuffix(KvSequence& seq, int64_t num_tokens, Stream& stream, const void* src,
                            MemorySpace src_space);

 private:
  friend class KvSequence;
  KvCache(Device* device, const KvCacheConfig& config, DeviceBuffer memory);

  // All-or-nothing allocation of `count` blocks appended to `out`.
  absl::Status AllocateBlocks(int64_t count, std::vector<int32_t>* out);
  void FreeBlocks(const std::vector<int32_t>& blocks);
  // Copies the rows of `seq`'s tokens [0, n) of every layer to/from a hand-off buffer.
  // Copies tokens [first, n) between `blocks` and the flat hand-off buffer of n tokens per layer.
  absl::Status CopyRows(const std::vector<int32_t>& blocks, int64_t first, int64_t n,
                        Stream& stream, void* flat, MemorySpace space, bool to_flat);

  Device* device_;
  KvCacheConfig config_;
  DeviceBuffer memory_;
  // std::mutex, not absl::Mutex: see common/device/sync_internal.h.
  mutable std::mutex mu_;
  std::vector<int32_t> free_;  // guarded by mu_: stack of free block indices
  std::vector<int32_t> refs_;  // guarded by mu_: references per block (0 = in free_)
};

}  // namespace hmoe

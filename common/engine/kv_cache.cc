#include "common/engine/kv_cache.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"

namespace hmoe {

KvCacheConfig KvCacheConfig::ForModel(const ModelConfig& model, int64_t num_blocks,
                                      int64_t block_size) {
  KvCacheConfig c;
  c.num_layers = model.num_hidden_layers;
  c.kv_lora_rank = model.kv_lora_rank;
  c.rope_dim = model.qk_rope_head_dim;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  return c;
}

// ---------------------------------------------------------------------------------- KvSequence

KvSequence::~KvSequence() { Reset(); }

KvSequence::KvSequence(KvSequence&& other) noexcept
    : cache_(std::exchange(other.cache_, nullptr)),
      blocks_(std::move(other.blocks_)),
      num_tokens_(std::exchange(other.num_tokens_, 0)) {
  other.blocks_.clear();
}

KvSequence& KvSequence::operator=(KvSequence&& other) noexcept {
  if (this != &other) {
    Reset();
    cache_ = std::exchange(other.cache_, nullptr);
    blocks_ = std::move(other.blocks_);
    other.blocks_.clear();
    num_tokens_ = std::exchange(other.num_tokens_, 0);
  }
  return *this;
}

int64_t KvSequence::capacity_tokens() const {
  return cache_ == nullptr ? 0 : static_cast<int64_t>(blocks_.size()) * cache_->config().block_size;
}

absl::Status KvSequence::Reserve(int64_t total_tokens) {
  if (cache_ == nullptr) return absl::FailedPreconditionError("kv sequence: not bound to a cache");
  const int64_t block_size = cache_->config().block_size;
  const int64_t needed = (total_tokens + block_size - 1) / block_size;
  const int64_t have = static_cast<int64_t>(blocks_.size());
  if (needed <= have) return absl::OkStatus();
  return cache_->AllocateBlocks(needed - have, &blocks_);
}

void KvSequence::Shrink(int64_t total_tokens) {
  if (cache_ == nullptr) return;
  const int64_t block_size = cache_->config().block_size;
  const int64_t keep = (std::max(total_tokens, num_tokens_) + block_size - 1) / block_size;
  if (keep >= static_cast<int64_t>(blocks_.size())) return;
  std::vector<int32_t> freed(blocks_.begin() + keep, blocks_.end());
  blocks_.resize(keep);
  cache_->FreeBlocks(freed);
}

void KvSequence::SetNumTokens(int64_t num_tokens) {
  HMOE_CHECK(num_tokens >= 0 && num_tokens <= capacity_tokens())
      << "num_tokens " << num_tokens << " capacity " << capacity_tokens();
  num_tokens_ = num_tokens;
}

absl::Status KvSequence::AdoptBlocks(const std::vector<int32_t>& blocks, int64_t num_tokens) {
  if (cache_ == nullptr) return absl::FailedPreconditionError("kv sequence: not bound to a cache");
  if (!blocks_.empty() || num_tokens_ != 0) {
    return absl::FailedPreconditionError("kv sequence: adopting blocks into a non-empty sequence");
  }
  const int64_t block_size = cache_->config().block_size;
  if (num_tokens < 0 || num_tokens > static_cast<int64_t>(blocks.size()) * block_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv sequence: ", num_tokens, " tokens in ", blocks.size(), " blocks"));
  }
  cache_->Retain(blocks);
  blocks_ = blocks;
  num_tokens_ = num_tokens;
  return absl::OkStatus();
}

void KvSequence::Reset() {
  if (cache_ != nullptr && !blocks_.empty()) cache_->FreeBlocks(blocks_);
  blocks_.clear();
  num_tokens_ = 0;
}

// ---------------------------------------------------------------------------------- KvCache

KvCache::KvCache(Device* device, const KvCacheConfig& config, DeviceBuffer memory)
    : device_(device), config_(config), memory_(std::move(memory)) {
  free_.reserve(config.num_blocks);
  refs_.assign(config.num_blocks, 0);
  // A stack: block 0 is handed out first.
  for (int64_t b = config.num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

KvCache::~KvCache() = default;

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(Device& device,
                                                         const KvCacheConfig& config) {
  if (config.num_layers <= 0 || config.kv_lora_rank <= 0 || config.rope_dim <= 0 ||
      config.block_size <= 0 || config.num_blocks <= 0 || config.num_blocks > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv cache: bad config (layers ", config.num_layers, ", kv_lora_rank ",
                     config.kv_lora_rank, ", rope_dim ", config.rope_dim, ", block_size ",
                     config.block_size, ", blocks ", config.num_blocks, ")"));
  }
  HMOE_ASSIGN_OR_RETURN(DeviceBuffer memory, device.Allocate(config.pool_bytes()));
  return std::unique_ptr<KvCache>(new KvCache(&device, config, std::move(memory)));
}

int64_t KvCache::num_free_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(free_.size());
}

KvLayerView KvCache::layer_view(int64_t layer) const {
  HMOE_CHECK(layer >= 0 && layer < config_.num_layers) << "layer " << layer;
  KvLayerView v;
  v.block_size = config_.block_size;
  v.row_floats = config_.row_floats();
  v.block_stride = config_.block_size * v.row_floats;
  v.base = memory_.as<float>() + layer * config_.num_blocks * v.block_stride;
  return v;
}

absl::Status KvCache::AllocateBlocks(int64_t count, std::vector<int32_t>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (count > static_cast<int64_t>(free_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat("kv cache full: ", count, " blocks needed, ",
                                                     free_.size(), " of ", config_.num_blocks,
                                                     " free"));
  }
  for (int64_t i = 0; i < count; ++i) {
    out->push_back(free_.back());
    refs_[free_.back()] = 1;
    free_.pop_back();
  }
  return absl::OkStatus();
}

void KvCache::FreeBlocks(const std::vector<int32_t>& blocks) { Release(blocks); }

absl::StatusOr<int32_t> KvCache::AllocateBlock() {
  std::vector<int32_t> one;
  HMOE_RETURN_IF_ERROR(AllocateBlocks(1, &one));
  return one[0];
}

void KvCache::Retain(const std::vector<int32_t>& blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int32_t b : blocks) {
    HMOE_CHECK(b >= 0 && b < config_.num_blocks && refs_[b] > 0) << "retain of free block " << b;
    ++refs_[b];
  }
}

void KvCache::Release(const std::vector<int32_t>& blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  // Reverse order, so a sequence's first block is handed out first again (a stack).
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int32_t b = *it;
    HMOE_CHECK(b >= 0 && b < config_.num_blocks && refs_[b] > 0) << "release of free block " << b;
    if (--refs_[b] == 0) free_.push_back(b);
  }
}

int32_t KvCache::block_refs(int32_t block) const {
  std::lock_guard<std::mutex> lock(mu_);
  HMOE_CHECK(block >= 0 && block < config_.num_blocks) << "block " << block;
  return refs_[block];
}

absl::Status KvCache::CopyBlockRows(int32_t src, int32_t dst, int64_t rows, Stream& stream) {
  if (src < 0 || src >= config_.num_blocks || dst < 0 || dst >= config_.num_blocks || rows < 0 ||
      rows > config_.block_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv copy: blocks ", src, " -> ", dst, ", ", rows, " rows"));
  }
  if (rows == 0 || src == dst) return absl::OkStatus();
  const size_t bytes = static_cast<size_t>(rows * config_.row_floats()) * sizeof(float);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const KvLayerView view = layer_view(l);
    HMOE_RETURN_IF_ERROR(device_->CopyOnDevice(stream, view.base + dst * view.block_stride,
                                               view.base + src * view.block_stride, bytes));
  }
  return absl::OkStatus();
}

size_t KvCache::ExportBytes(int64_t num_tokens) const {
  return static_cast<size_t>(config_.num_layers * num_tokens * config_.row_floats()) *
         sizeof(float);
}

absl::Status KvCache::CopyRows(const std::vector<int32_t>& blocks, int64_t first, int64_t n,
                               Stream& stream, void* flat, MemorySpace space, bool to_flat) {
  const int64_t rf = config_.row_floats();
  const int64_t bs = config_.block_size;
  const size_t row_bytes = static_cast<size_t>(rf) * sizeof(float);
  std::byte* base = static_cast<std::byte*>(flat);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const KvLayerView view = layer_view(l);
    // One copy per run of tokens contiguous in a block.
    for (int64_t t0 = first; t0 < n;) {
      const int64_t count = std::min(bs - t0 % bs, n - t0);
      float* rows =
          view.base + static_cast<int64_t>(blocks[t0 / bs]) * view.block_stride + (t0 % bs) * rf;
      std::byte* other = base + static_cast<size_t>(l * n + t0) * row_bytes;
      const size_t bytes = static_cast<size_t>(count) * row_bytes;
      if (space == MemorySpace::kDevice) {
        HMOE_RETURN_IF_ERROR(to_flat ? device_->CopyOnDevice(stream, other, rows, bytes)
                                     : device_->CopyOnDevice(stream, rows, other, bytes));
      } else {
        HMOE_RETURN_IF_ERROR(to_flat ? device_->CopyToHost(stream, other, rows, bytes)
                                     : device_->CopyToDevice(stream, rows, other, bytes));
      }
      t0 += count;
    }
  }
  return absl::OkStatus();
}

absl::Status KvCache::Export(const KvSequence& seq, Stream& stream, void* dst,
                             MemorySpace dst_space) {
  if (seq.cache() != this) {
    return absl::InvalidArgumentError("kv export: the sequence belongs to another cache");
  }
  if (seq.num_tokens() == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("kv export: null destination");
  return CopyRows(seq.block_table(), 0, seq.num_tokens(), stream, dst, dst_space, /*to_flat=*/true);
}

absl::Status KvCache::ExportBlocks(const std::vector<int32_t>& blocks, int64_t num_tokens,
                                   Stream& stream, void* dst, MemorySpace dst_space) {
  if (num_tokens < 0 || num_tokens > static_cast<int64_t>(blocks.size()) * config_.block_size) {
    return absl::InvalidArgumentError(absl::StrCat("kv export: ", num_tokens, " tokens in ",
                                                   blocks.size(), " blocks of ",
                                                   config_.block_size));
  }
  for (const int32_t b : blocks) {
    if (b < 0 || b >= config_.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv export: block ", b, " is not in the pool"));
    }
  }
  if (num_tokens == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("kv export: null destination");
  return CopyRows(blocks, 0, num_tokens, stream, dst, dst_space, /*to_flat=*/true);
}

absl::Status KvCache::Import(KvSequence& seq, int64_t num_tokens, Stream& stream, const void* src,
                             MemorySpace src_space) {
  if (seq.cache() != this) {
    return absl::InvalidArgumentError("kv import: the sequence belongs to another cache");
  }
  if (seq.num_tokens() != 0 || !seq.block_table().empty()) {
    return absl::FailedPreconditionError("kv import: the sequence is not empty");
  }
  if (num_tokens < 0 || (num_tokens > 0 && src == nullptr)) {
    return absl::InvalidArgumentError("kv import: bad source");
  }
  if (num_tokens == 0) return absl::OkStatus();
  HMOE_RETURN_IF_ERROR(seq.Reserve(num_tokens));
  absl::Status copied =
      CopyRows(seq.block_table(), 0, num_tokens, stream, const_cast<void*>(src), src_space,
               /*to_flat=*/false);
  if (!copied.ok()) {
    seq.Reset();
    return copied;
  }
  seq.SetNumTokens(num_tokens);
  return absl::OkStatus();
}

absl::Status KvCache::ImportSuffix(KvSequence& seq, int64_t num_tokens, Stream& stream,
                                   const void* src, MemorySpace src_space) {
  if (seq.cache() != this) {
    return absl::InvalidArgumentError("kv import: the sequence belongs to another cache");
  }
  const int64_t first = seq.num_tokens();
  if (num_tokens <= first || src == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv import: ", num_tokens, " tokens into a sequence holding ", first));
  }
  HMOE_RETURN_IF_ERROR(seq.Reserve(num_tokens));
  HMOE_RETURN_IF_ERROR(CopyRows(seq.block_table(), first, num_tokens, stream,
                                const_cast<void*>(src), src_space, /*to_flat=*/false));
  seq.SetNumTokens(num_tokens);
  return absl::OkStatus();
}

}  // namespace hmoe

// Tests of the paged MLA KV cache (common/engine/kv_cache.h): block accounting, the device layout,
// and the hand-off format.

#include "common/engine/kv_cache.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "common/device/cpu_device.h"

namespace hmoe {
namespace {

KvCacheConfig SmallConfig(int64_t blocks, int64_t block_size) {
  KvCacheConfig c;
  c.num_layers = 3;
  c.kv_lora_rank = 8;
  c.rope_dim = 4;
  c.block_size = block_size;
  c.num_blocks = blocks;
  return c;
}

// Fills every token row of every layer of `seq` with a value derived from (layer, token, i).
void Fill(KvCache& cache, const KvSequence& seq, int64_t n, float offset) {
  const KvCacheConfig& c = cache.config();
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const KvLayerView v = cache.layer_view(l);
    for (int64_t t = 0; t < n; ++t) {
      float* row = v.base + seq.block_table()[t / c.block_size] * v.block_stride +
                   (t % c.block_size) * v.row_floats;
      for (int64_t i = 0; i < v.row_floats; ++i) row[i] = offset + l * 1000 + t * 10 + i * 0.5f;
    }
  }
}

TEST(KvCacheTest, BlocksAreReservedAllOrNothingAndReturned) {
  auto device = NewCpuDevice();
  auto cache = KvCache::Create(*device, SmallConfig(5, 4));
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(device->bytes_in_use(), SmallConfig(5, 4).pool_bytes());
  KvSequence a = (*cache)->NewSequence();
  ASSERT_TRUE(a.Reserve(9).ok());  // 3 blocks
  EXPECT_EQ(a.block_table().size(), 3u);
  EXPECT_EQ(a.capacity_tokens(), 12);
  EXPECT_EQ((*cache)->num_free_blocks(), 2);
  KvSequence b = (*cache)->NewSequence();
  const absl::Status full = b.Reserve(12);  // needs 3, only 2 free
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_TRUE(b.block_table().empty());
  EXPECT_EQ((*cache)->num_free_blocks(), 2);
  a.SetNumTokens(5);
  a.Shrink(0);  // keeps the blocks of its 5 tokens
  EXPECT_EQ(a.block_table().size(), 2u);
  EXPECT_EQ((*cache)->num_free_blocks(), 3);
  {
    KvSequence moved = std::move(a);
    EXPECT_EQ(moved.num_tokens(), 5);
  }  // destroyed: blocks returned
  EXPECT_EQ((*cache)->num_free_blocks(), 5);
  EXPECT_TRUE(b.Reserve(20).ok());
  EXPECT_EQ((*cache)->num_free_blocks(), 0);
}

TEST(KvCacheTest, CreateRespectsTheDeviceBudget) {
  CpuDeviceOptions options;
  options.budget_bytes = SmallConfig(5, 4).pool_bytes() - 1;
  auto device = NewCpuDevice(options);
  EXPECT_EQ(KvCache::Create(*device, SmallConfig(5, 4)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(KvCache::Create(*device, SmallConfig(0, 4)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvCacheTest, ExportUsesTheDocumentedLayoutAndImportRestoresIt) {
  auto device = NewCpuDevice();
  auto stream = device->CreateStream();
  ASSERT_TRUE(stream.ok());
  auto cache = KvCache::Create(*device, SmallConfig(8, 4));
  ASSERT_TRUE(cache.ok());
  KvSequence seq = (*cache)->NewSequence();
  // Interleave another sequence's blocks so the table is not contiguous.
  KvSequence other = (*cache)->NewSequence();
  ASSERT_TRUE(other.Reserve(4).ok());
  ASSERT_TRUE(seq.Reserve(10).ok());
  seq.SetNumTokens(10);
  Fill(**cache, seq, 10, 0.25f);
  const size_t bytes = (*cache)->ExportBytes(10);
  EXPECT_EQ(bytes, 3u * 10 * 12 * 4);
  std::vector<float> flat(bytes / 4);
  ASSERT_TRUE((*cache)->Export(seq, **stream, flat.data(), MemorySpace::kHost).ok());
  // Layer-major, then token-major: latent then rope key.
  for (int64_t l = 0; l < 3; ++l) {
    for (int64_t t = 0; t < 10; ++t) {
      for (int64_t i = 0; i < 12; ++i) {
        ASSERT_EQ(flat[(l * 10 + t) * 12 + i], 0.25f + l * 1000 + t * 10 + i * 0.5f);
      }
    }
  }
  // Into a cache of another block size; device-side source as well.
  auto second = KvCache::Create(*device, SmallConfig(4, 16));
  ASSERT_TRUE(second.ok());
  KvSequence copy = (*second)->NewSequence();
  ASSERT_TRUE((*second)->Import(copy, 10, **stream, flat.data(), MemorySpace::kDevice).ok());
  std::vector<float> again(bytes / 4);
  ASSERT_TRUE((*second)->Export(copy, **stream, again.data(), MemorySpace::kDevice).ok());
  EXPECT_EQ(flat, again);
  // Wrong cache / full cache.
  EXPECT_EQ((*second)->Export(seq, **stream, again.data(), MemorySpace::kHost).code(),
            absl::StatusCode::kInvalidArgument);
  KvSequence big = (*second)->NewSequence();
  std::vector<float> lots((*second)->ExportBytes(64) / 4);
  EXPECT_EQ((*second)->Import(big, 64, **stream, lots.data(), MemorySpace::kHost).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(big.block_table().empty());
}

}  // namespace
}  // namespace hmoe

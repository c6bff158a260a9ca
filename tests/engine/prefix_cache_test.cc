// Tests of the prefix cache (common/engine/prefix_cache.h) over a real KvCache on the CPU device:
// reuse of whole blocks and copy on write, block references, LRU eviction under a budget and
// under pool pressure, and a randomized run against a brute-force oracle that checks every reused
// row holds the KV written for exactly that prefix.

#include "common/engine/prefix_cache.h"

#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "common/device/cpu_device.h"

namespace hmoe {
namespace {

KvCacheConfig Config(int64_t blocks, int64_t block_size) {
  KvCacheConfig c;
  c.num_layers = 2;
  c.kv_lora_rank = 3;
  c.rope_dim = 2;
  c.block_size = block_size;
  c.num_blocks = blocks;
  return c;
}

// The KV a model would write for position t of `tokens`: a function of tokens[0..t] (all of the
// prefix, as in attention), layer and channel.
float RowValue(const std::vector<int32_t>& tokens, int64_t t, int64_t layer, int64_t i) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t k = 0; k <= t; ++k)
    h = (h ^ static_cast<uint64_t>(tokens[k] + 7)) * 1099511628211ull;
  return static_cast<float>((h >> 40) % 100000) + 0.25f * static_cast<float>(layer * 10 + i);
}

float* Row(KvCache& cache, const KvSequence& seq, int64_t layer, int64_t t) {
  const KvLayerView v = cache.layer_view(layer);
  const int64_t bs = cache.config().block_size;
  return v.base + seq.block_table()[t / bs] * v.block_stride + (t % bs) * v.row_floats;
}

// Appends tokens [seq.num_tokens(), tokens.size()) to `seq` as the engine would: reserve, write
// the rows, set the count.
void Append(KvCache& cache, KvSequence& seq, const std::vector<int32_t>& tokens) {
  ASSERT_TRUE(seq.Reserve(static_cast<int64_t>(tokens.size())).ok());
  for (int64_t t = seq.num_tokens(); t < static_cast<int64_t>(tokens.size()); ++t) {
    for (int64_t l = 0; l < cache.config().num_layers; ++l) {
      float* row = Row(cache, seq, l, t);
      for (int64_t i = 0; i < cache.config().row_floats(); ++i) row[i] = RowValue(tokens, t, l, i);
    }
  }
  seq.SetNumTokens(static_cast<int64_t>(tokens.size()));
}

// Every row of `seq` holds the KV of `tokens`' prefix up to it.
void ExpectRows(KvCache& cache, const KvSequence& seq, const std::vector<int32_t>& tokens) {
  for (int64_t t = 0; t < seq.num_tokens(); ++t) {
    for (int64_t l = 0; l < cache.config().num_layers; ++l) {
      const float* row = Row(cache, seq, l, t);
      for (int64_t i = 0; i < cache.config().row_floats(); ++i) {
        ASSERT_EQ(row[i], RowValue(tokens, t, l, i)) << "token " << t << " layer " << l;
      }
    }
  }
}

class PrefixCacheTest : public ::testing::Test {
 protected:
  void Make(int64_t blocks, int64_t block_size, int64_t budget) {
    prefix_.reset();
    cache_.reset();
    auto c = KvCache::Create(*device_, Config(blocks, block_size));
    ASSERT_TRUE(c.ok()) << c.status();
    cache_ = *std::move(c);
    prefix_ = std::make_unique<PrefixCache>(*cache_, budget);
  }
  // A finished sequence of `tokens`, offered to the tree.
  void Cache(const std::vector<int32_t>& tokens, bool finished = true) {
    KvSequence s = cache_->NewSequence();
    Append(*cache_, s, tokens);
    prefix_->Insert(tokens, s, finished);
  }

  std::unique_ptr<Device> device_ = NewCpuDevice();
  std::unique_ptr<Stream> stream_ = *device_->CreateStream();
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<PrefixCache> prefix_;
};

TEST_F(PrefixCacheTest, ReusesWholeBlocksAndCopiesThePartialOne) {
  Make(16, 4, 16);
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 2 full blocks + 2 tokens
  Cache(a);
  EXPECT_EQ(prefix_->stats().cached_blocks, 3);
  EXPECT_EQ(prefix_->stats().cached_tokens, 10);

  // Same prompt, one token must be computed: 9 reused (8 shared + 1 copied).
  KvSequence s = cache_->NewSequence();
  EXPECT_EQ(prefix_->Match(a, 9), 9);
  auto got = prefix_->Acquire(a, 9, s, *stream_);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 9);
  EXPECT_EQ(s.num_tokens(), 9);
  ASSERT_EQ(s.block_table().size(), 3u);
  EXPECT_EQ(cache_->block_refs(s.block_table()[0]), 2);  // tree + s
  EXPECT_EQ(cache_->block_refs(s.block_table()[1]), 2);
  EXPECT_EQ(cache_->block_refs(s.block_table()[2]), 1);  // the copy: s alone
  ExpectRows(*cache_, s, a);
  EXPECT_EQ(prefix_->stats().copied_tokens, 1);
  EXPECT_EQ(prefix_->evictable_blocks(), 1);  // the partial node; the two shared are in use

  // s appends beyond the shared blocks without touching the tree's rows.
  std::vector<int32_t> b = a;
  b[9] = 99;
  b.push_back(11);
  b.push_back(12);
  Append(*cache_, s, b);
  ExpectRows(*cache_, s, b);
  KvSequence check = cache_->NewSequence();
  ASSERT_EQ(*prefix_->Acquire(a, 10, check, *stream_), 10);
  ExpectRows(*cache_, check, a);
}

TEST_F(PrefixCacheTest, DivergingInsideABlockCopiesTheCommonRows) {
  Make(16, 4, 16);
  Cache({1, 2, 3, 4, 5, 6, 7, 8});
  const std::vector<int32_t> b = {1, 2, 3, 4, 5, 6, 0, 0, 0};
  KvSequence s = cache_->NewSequence();
  ASSERT_EQ(*prefix_->Acquire(b, 8, s, *stream_), 6);
  ExpectRows(*cache_, s, b);
  // Nothing in common: nothing reused, the sequence stays empty.
  KvSequence t = cache_->NewSequence();
  EXPECT_EQ(*prefix_->Acquire({{5, 5, 5}}, 2, t, *stream_), 0);
  EXPECT_EQ(t.num_tokens(), 0);
  EXPECT_TRUE(t.block_table().empty());
  EXPECT_EQ(prefix_->stats().lookups, 2);
  EXPECT_EQ(prefix_->stats().hits, 1);
  EXPECT_EQ(prefix_->stats().hit_tokens, 6);
}

TEST_F(PrefixCacheTest, AnUnfinishedSequenceOffersOnlyItsFullBlocks) {
  Make(16, 4, 16);
  KvSequence running = cache_->NewSequence();
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6};
  Append(*cache_, running, a);
  prefix_->Insert(a, running, /*finished=*/false);
  EXPECT_EQ(prefix_->stats().cached_blocks, 1);
  EXPECT_EQ(prefix_->Match(a, 6), 4);
  // The sequence keeps writing its second block; a reader of the first is unaffected.
  KvSequence reader = cache_->NewSequence();
  ASSERT_EQ(*prefix_->Acquire(a, 6, reader, *stream_), 4);
  EXPECT_EQ(reader.block_table()[0], running.block_table()[0]);
  EXPECT_EQ(cache_->block_refs(running.block_table()[0]), 3);
}

TEST_F(PrefixCacheTest, EvictsLeastRecentlyUsedLeavesToTheBudget) {
  Make(32, 4, 4);
  const std::vector<int32_t> a = {1, 1, 1, 1, 2, 2, 2, 2};
  const std::vector<int32_t> b = {3, 3, 3, 3, 4, 4, 4, 4};
  const std::vector<int32_t> c = {5, 5, 5, 5, 6, 6, 6, 6};
  Cache(a);
  Cache(b);
  EXPECT_EQ(prefix_->stats().cached_blocks, 4);
  // Use a: b is now the least recently used.
  {
    KvSequence s = cache_->NewSequence();
    ASSERT_EQ(*prefix_->Acquire(a, 8, s, *stream_), 8);
  }
  Cache(c);
  EXPECT_EQ(prefix_->stats().cached_blocks, 4);
  EXPECT_EQ(prefix_->stats().evicted_blocks, 2);
  EXPECT_EQ(prefix_->Match(a, 8), 8);
  EXPECT_EQ(prefix_->Match(b, 8), 0);
  EXPECT_EQ(prefix_->Match(c, 8), 8);
  // The pool got the evicted blocks back: 4 in the tree, the rest free.
  EXPECT_EQ(cache_->num_free_blocks(), 32 - 4);
}

TEST_F(PrefixCacheTest, NeverEvictsBlocksASequenceUses) {
  Make(32, 4, 2);
  const std::vector<int32_t> a = {1, 1, 1, 1, 2, 2, 2, 2};
  Cache(a);
  KvSequence user = cache_->NewSequence();
  ASSERT_EQ(*prefix_->Acquire(a, 8, user, *stream_), 8);
  Cache({7, 7, 7, 7, 8, 8, 8, 8});  // over budget; a is in use, so the newcomer goes
  EXPECT_EQ(prefix_->Match(a, 8), 8);
  EXPECT_FALSE(prefix_->EvictForFree(cache_->num_blocks()));
  ExpectRows(*cache_, user, a);
  user.Reset();
  EXPECT_EQ(prefix_->evictable_blocks(), 2);
  EXPECT_TRUE(prefix_->EvictForFree(cache_->num_blocks()));
  EXPECT_EQ(prefix_->stats().cached_blocks, 0);
  EXPECT_EQ(cache_->num_free_blocks(), cache_->num_blocks());
}

// Pin (a decode worker exporting a prefix to a prefill worker): the pinned blocks, whole ones and
// the partially matched one read in place, hold the prefix's rows in the hand-off layout
// (ExportBlocks: per layer, per token), and no eviction takes them until they are released.
TEST_F(PrefixCacheTest, PinnedPrefixesExportTheirRowsAndAreNotEvictedUntilReleased) {
  Make(32, 4, 8);
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 2 full blocks + 2 tokens
  Cache(a);
  const std::vector<int32_t> b = {1, 2, 3, 4, 5, 6, 7, 8, 9, 42, 43};
  auto [blocks, n] = prefix_->Pin(b, 10);
  ASSERT_EQ(n, 9);  // 8 in whole blocks + 1 row of the partial node
  ASSERT_EQ(blocks.size(), 3u);
  for (const int32_t block : blocks) EXPECT_EQ(cache_->block_refs(block), 2);  // tree + pin
  EXPECT_EQ(prefix_->stats().exports, 1);
  EXPECT_EQ(prefix_->stats().exported_tokens, 9);
  EXPECT_EQ(prefix_->stats().lookups, 0);

  const KvCacheConfig& c = cache_->config();
  std::vector<float> flat(cache_->ExportBytes(n) / sizeof(float), -1.0f);
  ASSERT_TRUE(cache_->ExportBlocks(blocks, n, *stream_, flat.data(), MemorySpace::kHost).ok());
  ASSERT_TRUE(stream_->Synchronize().ok());
  for (int64_t l = 0; l < c.num_layers; ++l) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < c.row_floats(); ++i) {
        ASSERT_EQ(flat[(l * n + t) * c.row_floats() + i], RowValue(b, t, l, i))
            << "layer " << l << " token " << t;
      }
    }
  }
  EXPECT_EQ(cache_->ExportBlocks(blocks, 13, *stream_, flat.data(), MemorySpace::kHost).code(),
            absl::StatusCode::kInvalidArgument);  // 3 blocks of 4 hold 12
  EXPECT_EQ(cache_->ExportBlocks({99}, 1, *stream_, flat.data(), MemorySpace::kHost).code(),
            absl::StatusCode::kInvalidArgument);

  // Pinned: pool pressure evicts nothing (the leaf is pinned, so its ancestors stay too).
  EXPECT_EQ(prefix_->evictable_blocks(), 0);
  EXPECT_FALSE(prefix_->EvictForFree(cache_->num_blocks()));
  EXPECT_EQ(prefix_->Match(a, 10), 10);
  cache_->Release(blocks);
  EXPECT_EQ(prefix_->evictable_blocks(), 3);
  EXPECT_TRUE(prefix_->EvictForFree(cache_->num_blocks()));
  EXPECT_EQ(cache_->num_free_blocks(), cache_->num_blocks());
  // Nothing cached: nothing pinned.
  auto [none, zero] = prefix_->Pin(b, 10);
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(zero, 0);
}

TEST_F(PrefixCacheTest, ALongerPartialReplacesAShorterOne) {
  Make(16, 4, 16);
  Cache({1, 2, 3, 4, 5});
  Cache({1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(prefix_->stats().cached_blocks, 2);
  EXPECT_EQ(prefix_->stats().cached_tokens, 7);
  Cache({1, 2, 3, 4, 5, 6});  // covered by the longer one
  EXPECT_EQ(prefix_->stats().cached_blocks, 2);
  EXPECT_EQ(prefix_->Match(std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}, 8), 7);
}

TEST_F(PrefixCacheTest, AZeroBudgetKeepsNothingAndDestructionReturnsEveryBlock) {
  Make(8, 4, 0);
  Cache({1, 2, 3, 4, 5});
  EXPECT_EQ(prefix_->stats().cached_blocks, 0);
  EXPECT_EQ(cache_->num_free_blocks(), 8);
  Make(8, 4, 8);
  Cache({1, 2, 3, 4, 5});
  Cache({9, 2, 3, 4, 5, 6, 7, 8, 9});
  EXPECT_EQ(cache_->num_free_blocks(), 8 - 5);
  prefix_.reset();
  EXPECT_EQ(cache_->num_free_blocks(), 8);
}

// Random prompts over a 3-token alphabet (many shared prefixes), inserted finished or not,
// reused with random caps, sequences kept alive at random; with a budget that never evicts, the
// reused length must be the oracle's (the longest prefix any offered sequence covers), and every
// reused row must hold its prefix's KV.
TEST_F(PrefixCacheTest, RandomizedAgainstABruteForceOracle) {
  const int64_t bs = 4;
  Make(4096, bs, 4096);
  std::mt19937 rng(12345);
  std::vector<std::pair<std::vector<int32_t>, int64_t>> offered;  // tokens, covered length
  std::vector<KvSequence> alive;
  for (int round = 0; round < 400; ++round) {
    std::vector<int32_t> tokens(1 + rng() % 14);
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % 3);
    const int64_t cap = static_cast<int64_t>(rng() % (tokens.size() + 1));
    int64_t expected = 0;
    for (const auto& [o, covered] : offered) {
      int64_t n = 0;
      while (n < covered && n < cap && o[n] == tokens[n]) ++n;
      expected = std::max(expected, n);
    }
    KvSequence s = cache_->NewSequence();
    ASSERT_EQ(prefix_->Match(tokens, cap), expected) << "round " << round;
    auto got = prefix_->Acquire(tokens, cap, s, *stream_);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(*got, expected) << "round " << round;
    ExpectRows(*cache_, s, tokens);
    Append(*cache_, s, tokens);
    ExpectRows(*cache_, s, tokens);
    const bool finished = rng() % 2 == 0;
    prefix_->Insert(tokens, s, finished);
    const auto n = static_cast<int64_t>(tokens.size());
    offered.emplace_back(tokens, finished ? n : n / bs * bs);
    if (!finished || rng() % 4 == 0) alive.push_back(std::move(s));
    if (alive.size() > 8) alive.erase(alive.begin());
  }
  EXPECT_EQ(prefix_->stats().evicted_blocks, 0);
  alive.clear();
  prefix_.reset();
  EXPECT_EQ(cache_->num_free_blocks(), cache_->num_blocks());
}

}  // namespace
}  // namespace hmoe

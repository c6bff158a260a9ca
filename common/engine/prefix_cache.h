#pragma once

// Prefix reuse over the paged MLA KV cache (docs/decode_worker.md "Prefix cache"): a radix tree
// keyed by token ids whose nodes are KV blocks. A token's KV depends only on the tokens before it
// (the engine's results do not depend on what shares a step or how a prompt is chunked), so a new
// sequence whose prompt starts with a cached prefix can start from that prefix's blocks and
// compute only the rest.
//
// - Nodes. Every node holds one KvCache block and the token ids it holds: a full node holds
//   block_size tokens and may have children (the next block); a partial node holds fewer, is
//   always a leaf and comes only from a finished sequence (nobody writes its block again). A
//   node's path from the root spells its tokens' prefix. The tree holds one reference on each
//   node's block (KvCache::Retain); a sequence that reuses a node holds another.
// - Reuse (Acquire). The longest cached prefix, at most `max_tokens`: whole full nodes are shared
//   (the sequence appends only beyond them); where the match ends inside a node (the tokens
//   diverge, or max_tokens ends it), that node's matched rows are copied into a fresh block the
//   sequence owns (copy on write).
// - Insertion. A sequence's full blocks join the tree when its prompt is prefilled (so requests
//   running at the same time share them), and all its blocks, the partial last one included,
//   when it finishes. Where the tree already has a node for the same tokens it keeps its own.
// - Eviction. Least recently used leaves first, and only leaves whose block nobody but the tree
//   holds (a node a running sequence uses is never evicted; its ancestors are in use as well).
//   After every insertion the tree shrinks to `max_blocks`; an allocation that finds the pool
//   short evicts too (EvictForFree), so cached blocks never keep a request from its KV.
//
// Thread-safe (one mutex): the decode worker's engine thread acquires and inserts, RPC threads
// look up.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

#include "common/engine/kv_cache.h"

namespace hmoe {

struct PrefixCacheStats {
  int64_t max_blocks = 0;       // the budget
  int64_t cached_blocks = 0;    // nodes in the tree
  int64_t cached_tokens = 0;    // tokens their blocks hold
  int64_t lookups = 0;          // Acquire calls
  int64_t hits = 0;             // Acquire calls that reused >= 1 token
  int64_t hit_tokens = 0;       // tokens reused
  int64_t copied_tokens = 0;    // of those, copied into a fresh block (copy on write)
  int64_t inserted_blocks = 0;  // nodes added
  int64_t evicted_blocks = 0;   // nodes evicted (budget or pool pressure)
  int64_t exports = 0;          // prefixes pinned for a prefill worker (Pin, >= 1 token)
  int64_t exported_tokens = 0;  // tokens they pinned
};

class PrefixCache {
 public:
  // A cache over `kv` (which must outlive it) holding at most max_blocks blocks (>= 0; 0 keeps
  // nothing).
  PrefixCache(KvCache& kv, int64_t max_blocks);
  // Releases every block the tree holds.
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // Tokens Acquire would reuse for `tokens` (at most max_tokens), without reusing them.
  int64_t Match(std::span<const int32_t> tokens, int64_t max_tokens) const;

  // Starts the empty sequence `seq` (of this cache's KvCache) with the longest cached prefix of
  // `tokens`, at most max_tokens, and returns its length (seq.num_tokens(); 0 when nothing
  // matched: seq unchanged). A partially matched node is copied on `stream`, which is
  // synchronized before returning; when no block is free for the copy, only the whole nodes are
  // reused. Errors only from the copy (seq is then empty).
  absl::StatusOr<int64_t> Acquire(std::span<const int32_t> tokens, int64_t max_tokens,
                                  KvSequence& seq, Stream& stream);

  // The blocks holding the longest cached prefix of `tokens`, at most max_tokens, with one
  // reference taken on each (release them with KvCache::Release when done), so they are neither
  // evicted nor reused while the caller reads them (KvCache::ExportBlocks: a decode worker
  // exporting a prefix to a prefill worker). Returns the blocks and the prefix length (the last
  // block may hold more rows than that); empty and 0 when nothing matched. Counted as an export,
  // not a lookup.
  std::pair<std::vector<int32_t>, int64_t> Pin(std::span<const int32_t> tokens, int64_t max_tokens);

  // Offers `seq`'s first n = min(seq.num_tokens(), tokens.size()) tokens, whose ids are
  // tokens[0, n), to the tree: its full blocks, and with `finished` (the sequence will write no
  // more) its partial last block too. Then evicts down to the budget.
  void Insert(std::span<const int32_t> tokens, const KvSequence& seq, bool finished);

  // Evicts unused leaves, least recently used first, until the pool has `free_blocks` free blocks
  // or nothing more can be evicted; true when the pool has them.
  bool EvictForFree(int64_t free_blocks);
  // Evicts unused leaves down to the budget (Insert does too, but the blocks a sequence still
  // held then could not go: call it when a sequence lets its blocks go).
  void TrimToBudget();
  // Blocks the tree holds that no sequence uses (all of them could be evicted now).
  int64_t evictable_blocks() const;

  PrefixCacheStats stats() const;

 private:
  struct Node {
    Node* parent = nullptr;
    int32_t block = -1;
    std::vector<int32_t> tokens;  // block_size tokens (full) or fewer (partial leaf)
    uint64_t last_use = 0;
    std::map<std::vector<int32_t>, std::unique_ptr<Node>> children;
  };
  using LeafKey = std::pair<uint64_t, Node*>;
  struct Found {
    std::vector<Node*> path;   // full nodes matched whole
    Node* partial = nullptr;   // where the match ends inside a node
    int64_t partial_rows = 0;  // tokens of `partial` matched
  };

  Found Find(std::span<const int32_t> tokens, int64_t max_tokens) const;
  // The child of `node` sharing the longest prefix with `key`, and that length.
  static std::pair<Node*, int64_t> LongestChild(const Node& node, const std::vector<int32_t>& key);
  Node* AddChild(Node* parent, std::vector<int32_t> tokens, int32_t block);
  void Touch(Node* node);
  // Removes the leaf `node` (its block reference released).
  void RemoveLeaf(Node* node);
  // Evicts the least recently used unused leaf; false when there is none.
  bool EvictOne();
  void EvictToBudget();

  KvCache& kv_;
  const int64_t block_size_;
  const int64_t max_blocks_;
  mutable std::mutex mu_;
  Node root_;                 // guarded by mu_; holds no block
  std::set<LeafKey> leaves_;  // guarded by mu_: leaves by last use
  uint64_t clock_ = 0;        // guarded by mu_
  PrefixCacheStats stats_;    // guarded by mu_
};

}  // namespace hmoe

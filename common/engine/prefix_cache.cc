#include "common/engine/prefix_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"

namespace hmoe {
namespace {

int64_t CommonPrefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

}  // namespace

PrefixCache::PrefixCache(KvCache& kv, int64_t max_blocks)
    : kv_(kv), block_size_(kv.config().block_size), max_blocks_(std::max<int64_t>(max_blocks, 0)) {
  stats_.max_blocks = max_blocks_;
}

PrefixCache::~PrefixCache() {
  std::lock_guard<std::mutex> lock(mu_);
  // Leaves first, so every node is a leaf when it goes.
  while (!leaves_.empty()) RemoveLeaf(leaves_.begin()->second);
}

std::pair<PrefixCache::Node*, int64_t> PrefixCache::LongestChild(const Node& node,
                                                                 const std::vector<int32_t>& key) {
  // In lexicographic order the child sharing the longest prefix with `key` is next to key's
  // insertion point.
  std::pair<Node*, int64_t> best{nullptr, 0};
  auto it = node.children.lower_bound(key);
  auto consider = [&](auto i) {
    const int64_t n = CommonPrefix(i->first, key);
    if (n > best.second) best = {i->second.get(), n};
  };
  if (it != node.children.end()) consider(it);
  if (it != node.children.begin()) consider(std::prev(it));
  return best;
}

PrefixCache::Found PrefixCache::Find(std::span<const int32_t> tokens, int64_t max_tokens) const {
  Found f;
  const int64_t limit = std::min<int64_t>(max_tokens, static_cast<int64_t>(tokens.size()));
  const Node* node = &root_;
  int64_t done = 0;
  while (done < limit) {
    const int64_t take = std::min(block_size_, limit - done);
    std::vector<int32_t> key(tokens.begin() + done, tokens.begin() + done + take);
    if (take == block_size_) {
      auto it = node->children.find(key);
      if (it != node->children.end()) {
        f.path.push_back(it->second.get());
        node = it->second.get();
        done += block_size_;
        continue;
      }
    }
    auto [child, rows] = LongestChild(*node, key);
    if (child != nullptr) {
      f.partial = child;
      f.partial_rows = rows;
    }
    break;
  }
  return f;
}

int64_t PrefixCache::Match(std::span<const int32_t> tokens, int64_t max_tokens) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Found f = Find(tokens, max_tokens);
  return static_cast<int64_t>(f.path.size()) * block_size_ + f.partial_rows;
}

void PrefixCache::Touch(Node* node) {
  if (node->children.empty()) leaves_.erase({node->last_use, node});
  node->last_use = clock_;
  if (node->children.empty()) leaves_.insert({node->last_use, node});
}

absl::StatusOr<int64_t> PrefixCache::Acquire(std::span<const int32_t> tokens, int64_t max_tokens,
                                             KvSequence& seq, Stream& stream) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.lookups;
  Found f = Find(tokens, max_tokens);
  if (f.path.empty() && f.partial == nullptr) return 0;
  ++clock_;
  std::vector<int32_t> blocks;
  for (Node* n : f.path) {
    blocks.push_back(n->block);
    Touch(n);
  }
  int64_t reused = static_cast<int64_t>(f.path.size()) * block_size_;
  int32_t copy = -1;
  if (f.partial != nullptr) {
    absl::StatusOr<int32_t> fresh = kv_.AllocateBlock();
    if (fresh.ok()) {
      copy = *fresh;
      absl::Status copied = kv_.CopyBlockRows(f.partial->block, copy, f.partial_rows, stream);
      if (copied.ok()) copied = stream.Synchronize();
      if (!copied.ok()) {
        kv_.Release({copy});
        return copied;
      }
      blocks.push_back(copy);
      reused += f.partial_rows;
      stats_.copied_tokens += f.partial_rows;
      Touch(f.partial);
    }
  }
  if (reused == 0) return 0;
  // The sequence takes its own references; the fresh block's allocation reference goes.
  HMOE_RETURN_IF_ERROR(seq.AdoptBlocks(blocks, reused));
  if (copy >= 0) kv_.Release({copy});
  ++stats_.hits;
  stats_.hit_tokens += reused;
  return reused;
}

std::pair<std::vector<int32_t>, int64_t> PrefixCache::Pin(std::span<const int32_t> tokens,
                                                          int64_t max_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  Found f = Find(tokens, max_tokens);
  std::vector<int32_t> blocks;
  if (f.path.empty() && f.partial == nullptr) return {blocks, 0};
  ++clock_;
  for (Node* n : f.path) {
    blocks.push_back(n->block);
    Touch(n);
  }
  int64_t pinned = static_cast<int64_t>(f.path.size()) * block_size_;
  if (f.partial != nullptr && f.partial_rows > 0) {
    blocks.push_back(f.partial->block);
    pinned += f.partial_rows;
    Touch(f.partial);
  }
  kv_.Retain(blocks);
  ++stats_.exports;
  stats_.exported_tokens += pinned;
  return {std::move(blocks), pinned};
}

PrefixCache::Node* PrefixCache::AddChild(Node* parent, std::vector<int32_t> tokens, int32_t block) {
  if (parent != &root_ && parent->children.empty()) leaves_.erase({parent->last_use, parent});
  auto node = std::make_unique<Node>();
  node->parent = parent;
  node->block = block;
  node->last_use = clock_;
  node->tokens = tokens;
  Node* raw = node.get();
  parent->children.emplace(std::move(tokens), std::move(node));
  leaves_.insert({raw->last_use, raw});
  kv_.Retain({block});
  ++stats_.cached_blocks;
  stats_.cached_tokens += static_cast<int64_t>(raw->tokens.size());
  ++stats_.inserted_blocks;
  return raw;
}

void PrefixCache::RemoveLeaf(Node* node) {
  HMOE_CHECK(node != &root_ && node->children.empty()) << "removing a node with children";
  leaves_.erase({node->last_use, node});
  kv_.Release({node->block});
  --stats_.cached_blocks;
  stats_.cached_tokens -= static_cast<int64_t>(node->tokens.size());
  Node* parent = node->parent;
  parent->children.erase(parent->children.find(node->tokens));  // destroys node
  if (parent != &root_ && parent->children.empty()) leaves_.insert({parent->last_use, parent});
}

bool PrefixCache::EvictOne() {
  for (const LeafKey& leaf : leaves_) {
    if (kv_.block_refs(leaf.second->block) == 1) {  // only the tree holds it
      RemoveLeaf(leaf.second);
      ++stats_.evicted_blocks;
      return true;
    }
  }
  return false;
}

void PrefixCache::EvictToBudget() {
  while (stats_.cached_blocks > max_blocks_ && EvictOne()) {
  }
}

void PrefixCache::Insert(std::span<const int32_t> tokens, const KvSequence& seq, bool finished) {
  if (seq.cache() != &kv_) return;
  const int64_t n = std::min<int64_t>(seq.num_tokens(), static_cast<int64_t>(tokens.size()));
  const std::vector<int32_t>& table = seq.block_table();
  std::lock_guard<std::mutex> lock(mu_);
  if (max_blocks_ == 0 || n == 0) return;
  ++clock_;
  Node* node = &root_;
  int64_t done = 0;
  for (; done + block_size_ <= n; done += block_size_) {
    std::vector<int32_t> key(tokens.begin() + done, tokens.begin() + done + block_size_);
    auto it = node->children.find(key);
    if (it != node->children.end()) {
      node = it->second.get();
      Touch(node);
    } else {
      node = AddChild(node, std::move(key), table[done / block_size_]);
    }
  }
  if (finished && done < n) {
    std::vector<int32_t> key(tokens.begin() + done, tokens.begin() + n);
    // Already covered when a child starts with these tokens (the first child >= key does, if any).
    auto it = node->children.lower_bound(key);
    const bool covered = it != node->children.end() &&
                         CommonPrefix(it->first, key) == static_cast<int64_t>(key.size());
    if (covered) {
      Touch(it->second.get());
    } else {
      // Partial leaves holding a shorter prefix of these tokens become redundant.
      while (it != node->children.begin()) {
        auto prev = std::prev(it);
        Node* p = prev->second.get();
        if (CommonPrefix(prev->first, key) != static_cast<int64_t>(prev->first.size()) ||
            !p->children.empty() || kv_.block_refs(p->block) != 1) {
          break;
        }
        RemoveLeaf(p);
        it = node->children.lower_bound(key);
      }
      AddChild(node, std::move(key), table[done / block_size_]);
    }
  }
  EvictToBudget();
}

void PrefixCache::TrimToBudget() {
  std::lock_guard<std::mutex> lock(mu_);
  EvictToBudget();
}

bool PrefixCache::EvictForFree(int64_t free_blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  while (kv_.num_free_blocks() < free_blocks) {
    if (!EvictOne()) return false;
  }
  return true;
}

int64_t PrefixCache::evictable_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  // A node a sequence uses has all its ancestors in use too, so every unused node can go once its
  // unused descendants have.
  int64_t count = 0;
  std::vector<const Node*> stack{&root_};
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    if (n != &root_ && kv_.block_refs(n->block) == 1) ++count;
    for (const auto& [key, child] : n->children) stack.push_back(child.get());
  }
  return count;
}

PrefixCacheStats PrefixCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace hmoe

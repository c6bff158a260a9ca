#include "common/ops/cpu/moe_executor.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include <immintrin.h>
#include <numa.h>

#include "common/base/logging.h"
#include "common/kernels/cpu/f32_ops.h"
#include "common/model/dtype.h"

namespace hmoe {
namespace {

using cpu::Fp8MatrixView;

constexpr int64_t kBlock = 128;
constexpr int kMaxTopK = 8;
constexpr int kMaxShared = 2;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t WeightBytes(const Fp8MatrixView& w) {
  return w.rows * w.cols + CeilDiv(w.rows, kBlock) * CeilDiv(w.cols, kBlock) * 4;
}

// Zeroed memory on one NUMA node (plain aligned memory without libnuma support).
class NodeBuffer {
 public:
  NodeBuffer() = default;
  NodeBuffer(size_t bytes, int node) : bytes_(std::max<size_t>(64, (bytes + 63) / 64 * 64)) {
    if (numa_available() >= 0) {
      data_ = static_cast<std::byte*>(numa_alloc_onnode(bytes_, node));
      numa_ = true;
    } else {
      data_ = static_cast<std::byte*>(std::aligned_alloc(64, bytes_));
    }
    HMOE_CHECK(data_ != nullptr) << "allocate " << bytes_ << " bytes on node " << node;
    std::memset(data_, 0, bytes_);
  }
  ~NodeBuffer() {
    if (data_ == nullptr) return;
    if (numa_) {
      numa_free(data_, bytes_);
    } else {
      std::free(data_);
    }
  }
  NodeBuffer(NodeBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), bytes_(o.bytes_), numa_(o.numa_) {}
  NodeBuffer& operator=(NodeBuffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(numa_, o.numa_);
    return *this;
  }

  std::byte* data() const { return data_; }

 private:
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  bool numa_ = false;
};

enum class TaskKind : uint8_t { kGateUp, kDown };

struct Task {
  TaskKind kind;
  int32_t slot;
  int64_t begin;  // rows of the part's gate/up (kGateUp) or of down (kDown)
  int64_t end;
};

// An expert active in this batch.
struct Slot {
  const MoeExpertWeights* expert = nullptr;
  int n = 0;                     // tokens routed to it
  int64_t pair = 0;              // index of its first (token, expert) pair
  const std::byte* x = nullptr;  // packed activations of its tokens
  int64_t x_stride = 0;
  int32_t tokens[cpu::kMaxMatVecTokens] = {};
};

// Per-node counters, each on its own cache line.
struct alignas(64) Counter {
  std::atomic<int64_t> value{0};
};

void SpinPause(int i) {
  if (i < 4096) {
    _mm_pause();
  } else {
    std::this_thread::yield();  // another job (or another process) holds the CPU
  }
}

}  // namespace

struct MoeExecutor::Impl {
  CpuWorkerPool* pool;
  const cpu::Fp8Gemv* gemv;
  int64_t hidden;
  MoeExecutorOptions options;
  int num_nodes;
  int64_t max_pairs;
  int64_t max_slots;
  int64_t x_stride;    // packed bytes per token of hidden
  int64_t h_capacity;  // largest part intermediate the h buffers hold
  int64_t h_stride;    // packed bytes per token of h

  NodeBuffer x_packed;              // [max_tokens][x_stride]
  NodeBuffer x_gathered;            // [max_pairs][x_stride]
  std::vector<NodeBuffer> h;        // per node: [max_pairs][h_stride]
  std::vector<NodeBuffer> partial;  // per node: [max_pairs][hidden] F32

  // Per-Forward state, reused.
  std::vector<Slot> slots;
  std::vector<std::vector<Task>> tasks;                // per node
  std::vector<Counter> next_task;                      // per node
  std::unique_ptr<std::atomic<int32_t>[]> gu_pending;  // [slot * num_nodes + node]
  // Per token: (pair, weight) in summation order.
  std::vector<std::vector<std::pair<int64_t, float>>> token_pairs;

  float* Partial(int node, int64_t pair) const {
    return reinterpret_cast<float*>(partial[node].data()) + pair * hidden;
  }
  std::byte* H(int node, int64_t pair) const { return h[node].data() + pair * h_stride; }

  void RunTasks(int thread);
  void Reduce(int thread, int num_tokens, std::span<float> out);
};

absl::StatusOr<Fp8MatrixView> Fp8ViewOfWeight(const Weight& w) {
  const TensorView& t = w.tensor;
  if (t.dtype != DType::kF8E4M3 || t.shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight ", t.name, ": expected a 2-D F8_E4M3 tensor"));
  }
  const int64_t rows = t.shape[0], cols = t.shape[1];
  if (t.data == nullptr || static_cast<int64_t>(t.size_bytes) < rows * cols) {
    return absl::InvalidArgumentError(absl::StrCat("weight ", t.name, ": too few bytes"));
  }
  const TensorView& s = w.scale_inv;
  if (!w.has_scale || s.dtype != DType::kF32 || s.shape.size() != 2 ||
      s.shape[0] != CeilDiv(rows, kBlock) || s.shape[1] != CeilDiv(cols, kBlock) ||
      s.data == nullptr || static_cast<int64_t>(s.size_bytes) < s.shape[0] * s.shape[1] * 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight ", t.name, ": expected an F32 scale tensor of [",
                     CeilDiv(rows, kBlock), ", ", CeilDiv(cols, kBlock), "]"));
  }
  if (reinterpret_cast<uintptr_t>(s.data) % alignof(float) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight ", t.name, ": scale tensor is not 4-byte aligned"));
  }
  return Fp8MatrixView::Dense(reinterpret_cast<const uint8_t*>(t.data),
                              reinterpret_cast<const float*>(s.data), rows, cols);
}

absl::StatusOr<MoeExpertWeights> SplitExpert(const Fp8MatrixView& gate, const Fp8MatrixView& up,
                                             const Fp8MatrixView& down, int num_parts) {
  if (num_parts < 1 || gate.rows != up.rows || gate.cols != up.cols || down.rows != gate.cols ||
      down.cols != gate.rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split expert: inconsistent shapes gate [", gate.rows, ", ", gate.cols, "], up [", up.rows,
        ", ", up.cols, "], down [", down.rows, ", ", down.cols, "] into ", num_parts));
  }
  const int64_t blocks = CeilDiv(gate.rows, kBlock);
  MoeExpertWeights expert;
  for (int p = 0; p < num_parts; ++p) {
    const int64_t begin = std::min(gate.rows, blocks * p / num_parts * kBlock);
    const int64_t end = std::min(gate.rows, blocks * (p + 1) / num_parts * kBlock);
    expert.parts.push_back(
        {gate.RowSlice(begin, end), up.RowSlice(begin, end), down.ColSlice(begin, end)});
  }
  return expert;
}

absl::StatusOr<std::unique_ptr<MoeExecutor>> MoeExecutor::Create(
    CpuWorkerPool* pool, const cpu::Fp8Gemv* gemv, int64_t hidden,
    const MoeExecutorOptions& options) {
  if (pool == nullptr || gemv == nullptr || hidden <= 0 || options.max_tokens < 1 ||
      options.max_tokens > cpu::kMaxMatVecTokens || options.max_intermediate <= 0 ||
      options.gate_up_task_rows <= 0 || options.gate_up_task_rows % kBlock != 0 ||
      options.down_task_rows <= 0 || options.down_task_rows % kBlock != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("moe executor: bad options (hidden ", hidden, ", max_tokens ",
                     options.max_tokens, ", task rows ", options.gate_up_task_rows, "/",
                     options.down_task_rows, "; task rows must be multiples of 128)"));
  }
  auto impl = std::make_unique<Impl>();
  impl->pool = pool;
  impl->gemv = gemv;
  impl->hidden = hidden;
  impl->options = options;
  impl->num_nodes = pool->num_nodes();
  impl->max_pairs = static_cast<int64_t>(options.max_tokens) * (kMaxTopK + kMaxShared);
  impl->max_slots = options.max_experts_per_batch > 0 ? options.max_experts_per_batch
                                                      : options.max_tokens * kMaxTopK + 4;
  impl->x_stride = gemv->PackedBytes(hidden);
  // The largest part SplitExpert makes of max_intermediate, rounded up to whole blocks.
  impl->h_capacity = CeilDiv(CeilDiv(options.max_intermediate, kBlock), impl->num_nodes) * kBlock;
  impl->h_stride = gemv->PackedBytes(impl->h_capacity);
  const int node0 = pool->RealNode(0);
  impl->x_packed = NodeBuffer(options.max_tokens * impl->x_stride, node0);
  impl->x_gathered = NodeBuffer(impl->max_pairs * impl->x_stride, node0);
  for (int s = 0; s < impl->num_nodes; ++s) {
    impl->h.emplace_back(impl->max_pairs * impl->h_stride, pool->RealNode(s));
    impl->partial.emplace_back(impl->max_pairs * hidden * sizeof(float), pool->RealNode(s));
  }
  impl->slots.reserve(impl->max_slots);
  impl->tasks.resize(impl->num_nodes);
  impl->next_task = std::vector<Counter>(impl->num_nodes);
  impl->gu_pending.reset(new std::atomic<int32_t>[impl->max_slots * impl->num_nodes]);
  impl->token_pairs.resize(options.max_tokens);
  return std::unique_ptr<MoeExecutor>(new MoeExecutor(std::move(impl)));
}

MoeExecutor::MoeExecutor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeExecutor::~MoeExecutor() = default;

void MoeExecutor::Impl::RunTasks(int thread) {
  const int node = pool->NodeOfThread(thread);
  const std::vector<Task>& list = tasks[node];
  const int64_t count = static_cast<int64_t>(list.size());
  while (true) {
    // Relaxed: the counter only hands out indices; the task list was published by Run.
    const int64_t k = next_task[node].value.fetch_add(1, std::memory_order_relaxed);
    if (k >= count) return;
    const Task& task = list[k];
    const Slot& slot = slots[task.slot];
    const MoeExpertPart& part = slot.expert->parts[node];
    std::atomic<int32_t>& pending = gu_pending[task.slot * num_nodes + node];
    if (task.kind == TaskKind::kGateUp) {
      gemv->GateUpSilu(part.gate, part.up, slot.x, slot.x_stride, slot.n, task.begin, task.end,
                       H(node, slot.pair), h_stride);
      // Release: this slice of h is visible to the down tasks that acquire the count at zero.
      pending.fetch_sub(1, std::memory_order_release);
    } else {
      // The per-expert barrier: wait for this expert's gate/up slices on this node. They were
      // all handed out before this task, so the wait is bounded by tasks already running.
      for (int i = 0; pending.load(std::memory_order_acquire) != 0; ++i) SpinPause(i);
      gemv->MatVec(part.down, H(node, slot.pair), h_stride, slot.n, task.begin, task.end,
                   Partial(node, slot.pair) + task.begin, hidden);
    }
  }
}

void MoeExecutor::Impl::Reduce(int thread, int num_tokens, std::span<float> out) {
  const int threads = pool->num_threads();
  // Columns in multiples of 16 floats (whole cache lines).
  const int64_t groups = CeilDiv(hidden, 16);
  const int64_t c0 = std::min(hidden, groups * thread / threads * 16);
  const int64_t c1 = std::min(hidden, groups * (thread + 1) / threads * 16);
  for (int t = 0; t < num_tokens; ++t) {
    float* o = out.data() + t * hidden;
    std::fill(o + c0, o + c1, 0.0f);
    for (const auto& [pair, weight] : token_pairs[t]) {
      for (int s = 0; s < num_nodes; ++s) {
        const float* p = Partial(s, pair);
        // The same fused update as the grouped path's ScatterAddRows (bitwise equal results).
        cpu::AxpyF32(weight, p + c0, o + c0, c1 - c0);
      }
    }
  }
}

absl::Status MoeExecutor::Forward(const MoeLayerWeights& layer, std::span<const float> x,
                                  const MoeRouting& routing, std::span<float> out) {
  Impl& im = *impl_;
  const int64_t hidden = im.hidden;
  if (layer.hidden != hidden || x.size() % hidden != 0 || out.size() != x.size()) {
    return absl::InvalidArgumentError(absl::StrCat("moe forward: hidden ", layer.hidden, " (want ",
                                                   hidden, "), x ", x.size(), ", out ",
                                                   out.size()));
  }
  const int64_t num_tokens = static_cast<int64_t>(x.size()) / hidden;
  if (num_tokens > im.options.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "moe forward: ", num_tokens, " tokens, executor sized for ", im.options.max_tokens));
  }
  if (routing.top_k < 0 || routing.top_k > kMaxTopK ||
      routing.ids.size() != static_cast<size_t>(num_tokens * routing.top_k) ||
      routing.weights.size() != routing.ids.size() || layer.shared.size() > kMaxShared) {
    return absl::InvalidArgumentError(absl::StrCat(
        "moe forward: routing of ", routing.ids.size(), " ids / ", routing.weights.size(),
        " weights for ", num_tokens, " tokens x top ", routing.top_k, " (at most ", kMaxTopK, "), ",
        layer.shared.size(), " shared experts (at most ", kMaxShared, ")"));
  }
  if (num_tokens == 0) return absl::OkStatus();

  // Pack every token once (BF16, kernel order).
  for (int64_t t = 0; t < num_tokens; ++t) {
    im.gemv->Pack(x.data() + t * hidden, hidden, 0, hidden, im.x_packed.data() + t * im.x_stride);
  }

  // Active experts: routed ones in id order, then the shared ones.
  std::vector<int32_t> ids(routing.ids.begin(), routing.ids.end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const int64_t num_slots = static_cast<int64_t>(ids.size() + layer.shared.size());
  if (num_slots > im.max_slots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "moe forward: ", num_slots, " active experts, executor sized for ", im.max_slots));
  }
  im.slots.assign(num_slots, Slot{});
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= static_cast<int32_t>(layer.routed.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "moe forward: expert id ", ids[i], " out of range [0, ", layer.routed.size(), ")"));
    }
    im.slots[i].expert = &layer.routed[ids[i]];
  }
  for (size_t i = 0; i < layer.shared.size(); ++i) {
    im.slots[ids.size() + i].expert = &layer.shared[i];
  }
  for (int64_t t = 0; t < num_tokens; ++t) im.token_pairs[t].clear();
  // Tokens of each slot, in token order; then each (token, slot) pair gets an index.
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int j = 0; j < routing.top_k; ++j) {
      const int32_t id = routing.ids[t * routing.top_k + j];
      Slot& slot = im.slots[std::lower_bound(ids.begin(), ids.end(), id) - ids.begin()];
      if (slot.n == cpu::kMaxMatVecTokens) {
        return absl::InvalidArgumentError(absl::StrCat("moe forward: expert ", id,
                                                       " routed more than ", cpu::kMaxMatVecTokens,
                                                       " times in one batch"));
      }
      slot.tokens[slot.n++] = static_cast<int32_t>(t);
    }
  }
  for (size_t i = ids.size(); i < im.slots.size(); ++i) {
    Slot& slot = im.slots[i];
    for (int64_t t = 0; t < num_tokens; ++t) slot.tokens[slot.n++] = static_cast<int32_t>(t);
  }
  int64_t pairs = 0;
  int64_t weight_bytes = 0;
  for (Slot& slot : im.slots) {
    slot.pair = pairs;
    pairs += slot.n;
    if (slot.expert->parts.size() != static_cast<size_t>(im.num_nodes)) {
      return absl::InvalidArgumentError(
          absl::StrCat("moe forward: an expert has ", slot.expert->parts.size(),
                       " parts, the pool has ", im.num_nodes, " nodes"));
    }
    for (const MoeExpertPart& part : slot.expert->parts) {
      if (part.gate.cols != hidden || part.up.rows != part.gate.rows || part.up.cols != hidden ||
          part.down.rows != hidden || part.down.cols != part.gate.rows ||
          part.gate.rows > im.h_capacity) {
        return absl::InvalidArgumentError(absl::StrCat(
            "moe forward: expert part shapes gate [", part.gate.rows, ", ", part.gate.cols,
            "], up [", part.up.rows, ", ", part.up.cols, "], down [", part.down.rows, ", ",
            part.down.cols, "] do not fit hidden ", hidden, " and part capacity ", im.h_capacity));
      }
      weight_bytes += WeightBytes(part.gate) + WeightBytes(part.up) + WeightBytes(part.down);
    }
  }
  HMOE_CHECK(pairs <= im.max_pairs);
  for (int64_t t = 0; t < num_tokens; ++t) {
    // Summation order per token: the shared experts, then its routed experts in increasing id
    // order. The engine's grouped expert path (common/engine/engine.cc) adds in the same order,
    // so a token's result does not depend on which path its step takes (with one part per
    // expert: more parts add each expert's partial sums separately).
    for (size_t i = ids.size(); i < im.slots.size(); ++i) {
      im.token_pairs[t].emplace_back(im.slots[i].pair + t, 1.0f);
    }
    // Insertion sort of the (at most kMaxTopK) choices by expert id.
    std::array<std::pair<int32_t, float>, kMaxTopK> chosen;
    for (int j = 0; j < routing.top_k; ++j) {
      std::pair<int32_t, float> c(routing.ids[t * routing.top_k + j],
                                  routing.weights[t * routing.top_k + j]);
      int i = j;
      for (; i > 0 && chosen[i - 1].first > c.first; --i) chosen[i] = chosen[i - 1];
      chosen[i] = c;
    }
    for (int j = 0; j < routing.top_k; ++j) {
      const int32_t id = chosen[j].first;
      const Slot& slot = im.slots[std::lower_bound(ids.begin(), ids.end(), id) - ids.begin()];
      int index = 0;
      while (slot.tokens[index] != t) ++index;
      im.token_pairs[t].emplace_back(slot.pair + index, chosen[j].second);
    }
  }
  // Activations per slot: the packed batch itself when the slot has every token in order (the
  // shared experts; every expert at batch 1), else a gathered copy.
  for (Slot& slot : im.slots) {
    bool identity = slot.n == num_tokens;
    for (int i = 0; identity && i < slot.n; ++i) identity = slot.tokens[i] == i;
    slot.x_stride = im.x_stride;
    if (identity) {
      slot.x = im.x_packed.data();
    } else {
      std::byte* dst = im.x_gathered.data() + slot.pair * im.x_stride;
      for (int i = 0; i < slot.n; ++i) {
        std::memcpy(dst + i * im.x_stride, im.x_packed.data() + slot.tokens[i] * im.x_stride,
                    im.x_stride);
      }
      slot.x = dst;
    }
  }

  // Task lists: gate/up of slot i, then down of slot i-1, so a down task rarely waits.
  for (int s = 0; s < im.num_nodes; ++s) {
    std::vector<Task>& list = im.tasks[s];
    list.clear();
    auto add_down = [&](int32_t i) {
      if (im.slots[i].expert->parts[s].gate.rows == 0) return;  // empty part: contributes 0
      for (int64_t r = 0; r < hidden; r += im.options.down_task_rows) {
        list.push_back({TaskKind::kDown, i, r, std::min(hidden, r + im.options.down_task_rows)});
      }
    };
    for (int32_t i = 0; i < static_cast<int32_t>(num_slots); ++i) {
      const int64_t inter = im.slots[i].expert->parts[s].gate.rows;
      int32_t count = 0;
      for (int64_t r = 0; r < inter; r += im.options.gate_up_task_rows) {
        list.push_back(
            {TaskKind::kGateUp, i, r, std::min(inter, r + im.options.gate_up_task_rows)});
        ++count;
      }
      im.gu_pending[i * im.num_nodes + s].store(count, std::memory_order_relaxed);
      if (i > 0) add_down(i - 1);
    }
    add_down(static_cast<int32_t>(num_slots - 1));
    im.next_task[s].value.store(0, std::memory_order_relaxed);
  }
  // Parts with no rows write no partial; zero them so the reduction can sum every node.
  for (const Slot& slot : im.slots) {
    for (int s = 0; s < im.num_nodes; ++s) {
      if (slot.expert->parts[s].gate.rows == 0) {
        std::fill(im.Partial(s, slot.pair), im.Partial(s, slot.pair) + slot.n * hidden, 0.0f);
      }
    }
  }

  // Global barrier 1: every expert's gate/up and down, per node.
  im.pool->Run([&im](int thread) { im.RunTasks(thread); });
  // Global barrier 2: weighted sum of the partial outputs.
  im.pool->Run(
      [&im, num_tokens, out](int thread) { im.Reduce(thread, static_cast<int>(num_tokens), out); });
  last_active_experts_ = num_slots;
  last_weight_bytes_ = weight_bytes;
  return absl::OkStatus();
}

}  // namespace hmoe

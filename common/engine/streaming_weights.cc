#include "common/engine/streaming_weights.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/cpu_device.h"
#include "common/device/sync_internal.h"

namespace hmoe {
namespace {

// How often a pipeline wait re-checks for a failure or an abort elsewhere in the pipeline.
constexpr absl::Duration kPoll = absl::Milliseconds(20);
// Device offsets of the tensors of a module (DeviceBuffers and cudaMalloc are aligned this much).
constexpr size_t kTensorAlignment = 256;

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

size_t LinearBytes(const LinearWeight& w) {
  return DTypeBytes(w.dtype, (w.rows - 1) * w.row_stride + w.cols);
}

size_t ScaleBytes(const LinearWeight& w) {
  return static_cast<size_t>((CeilDiv(w.rows, kFp8BlockSize) - 1) * w.scale_stride +
                             CeilDiv(w.cols, kFp8BlockSize)) *
         sizeof(float);
}

// Calls f(pointer, bytes) for every device pointer of a module's views, in a fixed order (the
// order the relocation table of a module follows). `f` may change the pointer.
template <typename F>
void VisitLinear(LinearWeight& w, F& f) {
  if (w.data == nullptr) return;
  f(w.data, LinearBytes(w));
  if (w.dtype == DType::kF8E4M3 && w.scale_inv != nullptr) {
    const void* scale = w.scale_inv;
    f(scale, ScaleBytes(w));
    w.scale_inv = static_cast<const float*>(scale);
  }
}

template <typename F>
void VisitVector(VectorWeight& v, F& f) {
  if (v.data == nullptr) return;
  f(v.data, static_cast<size_t>(v.size) * DTypeSize(v.dtype));
}

template <typename F>
void VisitPointers(ModuleKind kind, ModuleWeights& m, F f) {
  switch (kind) {
    case ModuleKind::kAttention: {
      AttentionWeights& a = m.attention;
      VisitVector(a.input_norm, f);
      VisitVector(a.post_norm, f);
      VisitLinear(a.q_a, f);
      VisitVector(a.q_a_norm, f);
      VisitLinear(a.q_b, f);
      VisitLinear(a.q, f);
      VisitLinear(a.kv_a, f);
      VisitVector(a.kv_a_norm, f);
      VisitLinear(a.kv_b, f);
      for (LinearWeight& head : a.w_uk_t) VisitLinear(head, f);
      VisitLinear(a.o, f);
      VisitLinear(a.router, f);
      VisitVector(a.router_bias, f);
      return;
    }
    case ModuleKind::kDenseMlp:
    case ModuleKind::kSharedExperts:
    case ModuleKind::kRoutedExpert:
      VisitLinear(m.mlp.gate, f);
      VisitLinear(m.mlp.up, f);
      VisitLinear(m.mlp.down, f);
      return;
    case ModuleKind::kHead:
      VisitVector(m.head.final_norm, f);
      VisitLinear(m.head.lm_head, f);
      return;
  }
}

}  // namespace

double StreamingStats::hidden_fraction() const {
  if (copy_seconds <= 0) return 1.0;
  return std::clamp(1.0 - load_wait_seconds / copy_seconds, 0.0, 1.0);
}

// A host range copied as one piece to `offset` within the module's device memory.
struct StreamingWeights::Piece {
  const std::byte* src = nullptr;
  size_t bytes = 0;
  size_t offset = 0;
};

// One module of a pass: its plan (pieces, relocation), its event tuples, and, while loaded, its
// device memory and views.
struct StreamingWeights::Module {
  ModuleId id;
  bool ring = false;  // a routed expert: lives in a ring slot
  std::vector<Piece> pieces;
  size_t bytes = 0;           // device bytes (pieces at aligned offsets)
  size_t copy_bytes = 0;      // bytes copied per load
  ModuleWeights host;         // host views (the template)
  std::vector<size_t> reloc;  // device offset of each pointer, in VisitPointers order
  std::unique_ptr<EventTuple> on;
  std::unique_ptr<EventTuple> off;
  // Written by the loader before ON is signalled; read by the model after waiting for ON.
  ModuleWeights views;
  // Guarded by StreamingWeights::mu_.
  bool holds_memory = false;
  DeviceRingBuffer::Slot slot;
  StreamArena::Block block;
};

StreamingWeights::StreamingWeights(const StreamingWeightsOptions& options, Device* device)
    : options_(options), device_(device), load_expert_(options.load_expert) {}

StreamingWeights::~StreamingWeights() {
  bool running;
  {
    std::unique_lock<std::mutex> lock(mu_);
    running = running_;
  }
  if (running) (void)EndPrefill(/*abort=*/true);
  {
    std::unique_lock<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (loader_.joinable()) loader_.join();
  if (unloader_.joinable()) unloader_.join();
}

size_t DefaultStreamBudgetBytes(bool host_memory_device, size_t largest_module_bytes,
                                size_t largest_layer_bytes) {
  if (!host_memory_device) return std::max(kDefaultStreamBudgetBytes, largest_module_bytes);
  const size_t lookahead =
      std::min(kDefaultStreamBudgetBytes,
               static_cast<size_t>(kHostStreamLookaheadLayers) * largest_layer_bytes);
  return std::max(largest_module_bytes, lookahead);
}

absl::StatusOr<std::unique_ptr<StreamingWeights>> StreamingWeights::Create(
    const ModelConfig& config, const WeightSource& source, Device& device,
    const StreamingWeightsOptions& options) {
  if (options.ring_slots < 0 || options.stall_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("streaming weights: bad options (ring_slots ", options.ring_slots,
                     ", budget_bytes ", options.budget_bytes, ", stall_timeout ",
                     absl::FormatDuration(options.stall_timeout), ")"));
  }
  std::unique_ptr<StreamingWeights> w(new StreamingWeights(options, &device));
  // Host views of every module, read in place (a host device: nothing is copied).
  w->host_device_ = NewCpuDevice();
  HMOE_ASSIGN_OR_RETURN(w->host_, ResidentWeights::Create(config, source, *w->host_device_));
  w->config_ = config;
  HMOE_RETURN_IF_ERROR(w->Plan());
  const size_t budget =
      options.budget_bytes == 0
          ? AlignUp(DefaultStreamBudgetBytes(device.host_accessible(), w->largest_budget_module_,
                                             w->largest_layer_budget_),
                    StreamArena::kAlignment)
          : AlignUp(options.budget_bytes, StreamArena::kAlignment);
  for (const auto& m : w->modules_) {
    if (!m->ring && m->bytes > budget) {
      return absl::InvalidArgumentError(absl::StrCat(
          "streaming weights: module ", ModuleName(m->id), " needs ", m->bytes,
          " bytes of device memory, more than the streaming budget of ", options.budget_bytes,
          " bytes (the budget must hold the largest non-expert module: at least ",
          w->largest_budget_module_, " bytes)"));
    }
  }
  HMOE_ASSIGN_OR_RETURN(w->arena_, StreamArena::Create(device, budget));
  if (w->ring_slot_bytes_ > 0) HMOE_RETURN_IF_ERROR(w->SetRingSlots(options.ring_slots));
  HMOE_ASSIGN_OR_RETURN(w->loader_stream_, device.CreateStream());
  for (auto& m : w->modules_) {
    HMOE_ASSIGN_OR_RETURN(m->on, EventTuple::Create(device));
    HMOE_ASSIGN_OR_RETURN(m->off, EventTuple::Create(device));
  }
  w->slot_next_seq_.assign(w->modules_.size(), 0);
  StreamingWeights* self = w.get();
  w->loader_ = std::jthread([self] { self->LoaderLoop(); });
  w->unloader_ = std::jthread([self] { self->UnloaderLoop(); });
  return w;
}

absl::Status StreamingWeights::Plan() {
  const ModelConfig& c = config_;
  modules_.clear();
  loaded_experts_per_layer_ = 0;
  size_t slot_bytes = 0;  // published under mu_ at the end (ring_slot_bytes() is thread-safe)
  largest_budget_module_ = 0;
  largest_layer_budget_ = 0;
  std::vector<size_t> layer_budget_bytes(static_cast<size_t>(c.num_hidden_layers), 0);
  bytes_per_pass_ = 0;
  std::vector<ModuleId> order;
  std::vector<int64_t> loaded_per_layer;
  for (int32_t l = 0; l < static_cast<int32_t>(c.num_hidden_layers); ++l) {
    order.push_back({ModuleKind::kAttention, l, -1});
    if (!c.is_moe_layer(l)) {
      order.push_back({ModuleKind::kDenseMlp, l, -1});
      continue;
    }
    if (c.n_shared_experts > 0) order.push_back({ModuleKind::kSharedExperts, l, -1});
    int64_t loaded = 0;
    for (int32_t e = 0; e < static_cast<int32_t>(c.n_routed_experts); ++e) {
      if (load_expert_ && !load_expert_(l, e)) continue;
      order.push_back({ModuleKind::kRoutedExpert, l, e});
      ++loaded;
    }
    loaded_experts_per_layer_ = std::max(loaded_experts_per_layer_, loaded);
  }
  order.push_back({ModuleKind::kHead, -1, -1});

  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, host_device_->CreateStream());
  for (const ModuleId& id : order) {
    auto m = std::make_unique<Module>();
    m->id = id;
    m->ring = id.kind == ModuleKind::kRoutedExpert;
    HMOE_ASSIGN_OR_RETURN(const ModuleWeights* host, host_->Acquire(id, *stream));
    m->host = *host;
    HMOE_RETURN_IF_ERROR(host_->Release(id, *stream));
    // One piece per distinct host range (each tensor at an aligned device offset, as a device
    // allocation of its own would be); a pointer inside an earlier piece reuses it.
    size_t cursor = 0;
    VisitPointers(id.kind, m->host, [&](const void*& p, size_t bytes) {
      const auto* src = static_cast<const std::byte*>(p);
      for (const Piece& piece : m->pieces) {
        if (src >= piece.src && src + bytes <= piece.src + piece.bytes) {
          m->reloc.push_back(piece.offset + static_cast<size_t>(src - piece.src));
          return;
        }
      }
      cursor = AlignUp(cursor, kTensorAlignment);
      m->pieces.push_back(Piece{src, bytes, cursor});
      m->reloc.push_back(cursor);
      cursor += bytes;
      m->copy_bytes += bytes;
    });
    m->bytes = AlignUp(std::max<size_t>(cursor, 1), kTensorAlignment);
    if (m->ring) {
      slot_bytes = std::max(slot_bytes, m->bytes);
    } else {
      largest_budget_module_ = std::max(largest_budget_module_, m->bytes);
      if (id.layer >= 0) {
        size_t& layer = layer_budget_bytes[static_cast<size_t>(id.layer)];
        layer += m->bytes;
        largest_layer_budget_ = std::max(largest_layer_budget_, layer);
      }
    }
    bytes_per_pass_ += m->copy_bytes;
    if (id.kind == ModuleKind::kHead) head_bytes_ = m->copy_bytes;
    modules_.push_back(std::move(m));
  }
  std::unique_lock<std::mutex> lock(mu_);
  ring_slot_bytes_ = slot_bytes;
  return absl::OkStatus();
}

const TensorView& StreamingWeights::host_embedding() const { return host_->host_embedding(); }

const HostMoeWeights* StreamingWeights::host_moe(int64_t) const { return nullptr; }

std::vector<ModuleId> StreamingWeights::schedule() const {
  std::vector<ModuleId> out;
  for (const auto& m : modules_) out.push_back(m->id);
  return out;
}

size_t StreamingWeights::ring_slot_bytes() const {
  std::unique_lock<std::mutex> lock(mu_);
  return ring_slot_bytes_;
}

int64_t StreamingWeights::ring_slots() const {
  std::unique_lock<std::mutex> lock(mu_);
  return ring_ == nullptr ? 0 : ring_->num_slots();
}

size_t StreamingWeights::ring_bytes() const {
  std::unique_lock<std::mutex> lock(mu_);
  return ring_ == nullptr ? 0 : ring_->footprint_bytes();
}

absl::Status StreamingWeights::SetRingSlots(int64_t slots) {
  std::unique_lock<std::mutex> lock(mu_);
  if (running_) {
    return absl::FailedPreconditionError("streaming weights: ring resize during a prefill");
  }
  if (ring_slot_bytes_ == 0) return absl::OkStatus();  // no routed experts to stream
  const int64_t n = slots == 0 ? loaded_experts_per_layer_ : slots;
  if (n < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("streaming weights: ring of ", slots, " slots (must be >= 1)"));
  }
  if (ring_ != nullptr && ring_->num_slots() == n) return absl::OkStatus();
  ring_.reset();  // free the old ring before allocating the new one
  HMOE_ASSIGN_OR_RETURN(ring_, DeviceRingBuffer::Create(*device_, ring_slot_bytes_, n));
  return absl::OkStatus();
}

absl::Status StreamingWeights::SetLoadedExperts(
    std::function<bool(int64_t layer, int64_t expert)> load_expert) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (running_) {
      return absl::FailedPreconditionError(
          "streaming weights: expert subset change during a prefill");
    }
    // After EndPrefill both threads go idle; they touch modules_ again only once a prefill runs.
    cv_.wait(lock, [&] { return !loader_busy_ && !unloader_busy_; });
  }
  // Keep the old plan (and its event tuples) in case planning fails.
  std::vector<std::unique_ptr<Module>> old_modules = std::move(modules_);
  auto old_load_expert = std::move(load_expert_);
  const int64_t old_loaded = loaded_experts_per_layer_;
  const size_t old_layer = largest_layer_budget_;
  const size_t old_slot = ring_slot_bytes_, old_largest = largest_budget_module_,
               old_per_pass = bytes_per_pass_;
  auto restore = [&] {
    modules_ = std::move(old_modules);
    load_expert_ = std::move(old_load_expert);
    loaded_experts_per_layer_ = old_loaded;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ring_slot_bytes_ = old_slot;
    }
    largest_budget_module_ = old_largest;
    largest_layer_budget_ = old_layer;
    bytes_per_pass_ = old_per_pass;
  };
  load_expert_ = std::move(load_expert);
  if (absl::Status s = Plan(); !s.ok()) {
    restore();
    return s;
  }
  // Event tuples: reuse the old modules' (creating device events is not free on a GPU); create
  // the missing ones first, so a failure leaves the old plan in place.
  std::vector<std::unique_ptr<EventTuple>> fresh;
  for (size_t i = 2 * old_modules.size(); i < 2 * modules_.size(); ++i) {
    absl::StatusOr<std::unique_ptr<EventTuple>> t = EventTuple::Create(*device_);
    if (!t.ok()) {
      restore();
      return t.status();
    }
    fresh.push_back(*std::move(t));
  }
  for (auto& m : old_modules) {
    fresh.push_back(std::move(m->on));
    fresh.push_back(std::move(m->off));
  }
  old_modules.clear();
  for (auto& m : modules_) {
    m->on = std::move(fresh.back());
    fresh.pop_back();
    m->off = std::move(fresh.back());
    fresh.pop_back();
    m->on->Reset();
    m->off->Reset();
  }
  std::unique_lock<std::mutex> lock(mu_);
  slot_next_seq_.assign(modules_.size(), 0);
  // The ring keeps its slots; a slot must hold every streamed expert.
  if (ring_ != nullptr && ring_slot_bytes_ > ring_->slot_bytes()) {
    const int64_t slots = ring_->num_slots();
    ring_.reset();  // as SetRingSlots: free before allocating
    HMOE_ASSIGN_OR_RETURN(ring_, DeviceRingBuffer::Create(*device_, ring_slot_bytes_, slots));
  } else if (ring_ != nullptr) {
    ring_slot_bytes_ = ring_->slot_bytes();
  } else {
    ring_slot_bytes_ = std::max(ring_slot_bytes_, old_slot);
  }
  return absl::OkStatus();
}

absl::Status StreamingWeights::WaitLocked(std::unique_lock<std::mutex>& lock, absl::Time deadline,
                                          const std::function<bool()>& pred, const char* what) {
  while (true) {
    if (!error_.ok()) return error_;
    if (aborting_ || stopping_) {
      return absl::CancelledError(absl::StrCat("streaming weights: ", what, ": prefill aborted"));
    }
    if (pred()) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("streaming weights: ", what, ": stalled for ",
                                                      absl::FormatDuration(options_.stall_timeout),
                                                      " (stall_timeout)"));
    }
    cv_.wait_until(lock, absl::ToChronoTime(std::min(deadline, now + kPoll)));
  }
}

// ---------------------------------------------------------------------------------- model side

absl::Status StreamingWeights::BeginPrefill(int64_t num_passes, HeadStreaming head) {
  if (num_passes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("streaming weights: ", num_passes, " passes (must be >= 1)"));
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (running_) return absl::FailedPreconditionError("streaming weights: prefill already runs");
    // EndPrefill left both threads idle; make sure before resetting what they use.
    cv_.wait(lock, [&] { return !loader_busy_ && !unloader_busy_; });
    if (ring_ == nullptr && ring_slot_bytes_ > 0) {
      return absl::FailedPreconditionError("streaming weights: no experts ring (SetRingSlots)");
    }
    // The threads are idle (no prefill): the tuples may be reset.
    for (auto& m : modules_) {
      m->on->Reset();
      m->off->Reset();
    }
    const uint64_t per_pass = modules_.size();
    total_ = static_cast<uint64_t>(num_passes) * per_pass;
    head_ = head;
    loaded_ = 0;
    unloaded_ = 0;
    unload_queue_.clear();
    for (uint64_t i = 0; i < per_pass; ++i) slot_next_seq_[i] = i;
    error_ = absl::OkStatus();
    stats_ = StreamingStats();
    stats_.passes = num_passes;
    ring_in_use_ = 0;
    arena_->ResetPeak();
    model_seq_ = 0;
    held_.clear();
    prefill_start_ = absl::Now();
    running_ = true;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<const ModuleWeights*> StreamingWeights::Acquire(const ModuleId& id, Stream& stream) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options_.stall_timeout;
  Module* m = nullptr;
  const uint64_t seq = model_seq_;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!running_) {
      return absl::FailedPreconditionError(
          absl::StrCat("streaming weights: acquire of ", ModuleName(id), " outside a prefill"));
    }
    if (!error_.ok()) return error_;
    if (seq >= total_) {
      return absl::FailedPreconditionError(absl::StrCat("streaming weights: acquire of ",
                                                        ModuleName(id), " after all ",
                                                        stats_.passes, " passes of the prefill"));
    }
    m = modules_[seq % modules_.size()].get();
    if (!(m->id == id)) {
      if (id.kind == ModuleKind::kRoutedExpert && load_expert_ &&
          !load_expert_(id.layer, id.expert)) {
        return absl::FailedPreconditionError(absl::StrCat("streaming weights: ", ModuleName(id),
                                                          " is not streamed by this provider"));
      }
      return absl::FailedPreconditionError(absl::StrCat("streaming weights: acquire of ",
                                                        ModuleName(id), " out of order (expected ",
                                                        ModuleName(m->id), ")"));
    }
    // The module's tuples may still belong to the previous pass until it is unloaded.
    HMOE_RETURN_IF_ERROR(WaitLocked(
        lock, deadline, [&] { return slot_next_seq_[seq % modules_.size()] == seq; },
        "model waiting for a module slot"));
  }
  while (true) {
    const absl::Status s = m->on->Wait(stream, std::min(deadline, absl::Now() + kPoll));
    if (s.ok()) break;
    if (!absl::IsDeadlineExceeded(s)) return s;
    std::unique_lock<std::mutex> lock(mu_);
    if (!error_.ok()) return error_;
    if (aborting_) return absl::CancelledError("streaming weights: prefill aborted");
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("streaming weights: ", ModuleName(id), " not loaded within ",
                       absl::FormatDuration(options_.stall_timeout), " (stall_timeout)"));
    }
  }
  model_seq_ = seq + 1;
  held_.push_back(seq);
  {
    std::unique_lock<std::mutex> lock(mu_);
    stats_.load_wait_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  }
  return &m->views;
}

absl::Status StreamingWeights::Release(const ModuleId& id, Stream& stream) {
  const size_t per_pass = modules_.size();
  auto it = std::find_if(held_.begin(), held_.end(),
                         [&](uint64_t seq) { return modules_[seq % per_pass]->id == id; });
  if (it == held_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("streaming weights: release of ", ModuleName(id), ", which is not acquired"));
  }
  const uint64_t seq = *it;
  held_.erase(it);
  HMOE_RETURN_IF_ERROR(modules_[seq % per_pass]->off->Signal(stream));
  {
    std::unique_lock<std::mutex> lock(mu_);
    unload_queue_.push_back(seq);
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<StreamingStats> StreamingWeights::EndPrefill(bool abort) {
  absl::Status error;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!running_) return absl::FailedPreconditionError("streaming weights: no prefill runs");
    if (!abort) {
      if (model_seq_ != total_ || !held_.empty()) {
        error = absl::FailedPreconditionError(
            absl::StrCat("streaming weights: prefill ended after acquiring ", model_seq_, " of ",
                         total_, " modules (", held_.size(), " not released)"));
      } else {
        error = WaitLocked(
            lock, absl::Now() + options_.stall_timeout,
            // The loader finishes its bookkeeping of the last module (stats, loaded_) after
            // signalling it, possibly after the model and the unloader are done with it: wait
            // for that too, or the next BeginPrefill's reset could be overwritten.
            [&] {
              return unloaded_ == total_ && loaded_ == total_ && !loader_busy_ && !unloader_busy_;
            },
            "waiting for the last unloads");
      }
    }
  }
  if (abort || !error.ok()) CleanUp();
  std::unique_lock<std::mutex> lock(mu_);
  running_ = false;
  stats_.arena_peak_bytes = arena_->peak_bytes_in_use();
  stats_.wall_seconds = absl::ToDoubleSeconds(absl::Now() - prefill_start_);
  if (!error.ok()) return error;
  return stats_;
}

void StreamingWeights::CleanUp() {
  std::unique_lock<std::mutex> lock(mu_);
  aborting_ = true;
  cv_.notify_all();
  // The threads notice within kPoll (their waits poll) and go idle.
  cv_.wait(lock, [&] { return !loader_busy_ && !unloader_busy_; });
  for (auto& m : modules_) {
    if (absl::Status s = FreeSlotMemory(*m); !s.ok()) {
      HMOE_LOG(ERROR) << "streaming weights: free " << ModuleName(m->id) << ": " << s;
    }
    m->on->Reset();
    m->off->Reset();
  }
  arena_->Reset();
  unload_queue_.clear();
  held_.clear();
  model_seq_ = total_;
  // Not running any more before the abort flag drops, so the loader does not pick up the rest.
  running_ = false;
  aborting_ = false;
}

absl::Status StreamingWeights::FreeSlotMemory(Module& m) {
  if (!m.holds_memory) return absl::OkStatus();
  m.holds_memory = false;
  if (m.ring) {
    --ring_in_use_;
    return ring_->Release(m.slot);
  }
  return arena_->Free(m.block);
}

// ---------------------------------------------------------------------------------- loader

void StreamingWeights::LoaderLoop() {
  while (true) {
    uint64_t seq = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        return stopping_ || (running_ && !aborting_ && error_.ok() && loaded_ < total_);
      });
      if (stopping_) return;
      seq = loaded_;
      loader_busy_ = true;
    }
    const absl::Status s = Load(seq);
    {
      std::unique_lock<std::mutex> lock(mu_);
      loader_busy_ = false;
      if (s.ok()) {
        loaded_ = seq + 1;
      } else if (!aborting_ && error_.ok()) {
        error_ = s;  // the first error fails the prefill (an abort's own Cancelled is not one)
      }
    }
    cv_.notify_all();
  }
}

absl::Status StreamingWeights::Load(uint64_t seq) {
  const size_t index = seq % modules_.size();
  Module& m = *modules_[index];
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options_.stall_timeout;
  bool skip = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    HMOE_RETURN_IF_ERROR(WaitLocked(
        lock, deadline, [&] { return slot_next_seq_[index] == seq; },
        "loader waiting for the previous pass to unload a module"));
    if (m.id.kind == ModuleKind::kHead) {
      const bool last_pass = seq + modules_.size() >= total_;
      skip = head_ == HeadStreaming::kNever || (head_ == HeadStreaming::kLastPass && !last_pass);
    }
  }
  if (skip) {
    // Not streamed in this pass: null tensors, no device memory; the engine does not read them
    // (HeadStreaming).
    m.views = ModuleWeights{};
    HMOE_RETURN_IF_ERROR(m.on->Signal(*loader_stream_));
    std::unique_lock<std::mutex> lock(mu_);
    ++stats_.heads_skipped;
    return absl::OkStatus();
  }
  // Device memory: a ring slot or an arena block, waiting (in kPoll slices, so an abort or a
  // failure elsewhere interrupts the wait) until the unloader has freed enough.
  void* base = nullptr;
  while (base == nullptr) {
    const absl::Time slice = std::min(deadline, absl::Now() + kPoll);
    absl::Status status;
    if (m.ring) {
      absl::StatusOr<DeviceRingBuffer::Slot> slot = ring_->Acquire(slice);
      if (slot.ok()) {
        std::unique_lock<std::mutex> lock(mu_);
        m.slot = *slot;
        m.holds_memory = true;
        stats_.ring_peak_slots = std::max(stats_.ring_peak_slots, ++ring_in_use_);
        base = slot->data;
        break;
      }
      status = slot.status();
    } else {
      absl::StatusOr<StreamArena::Block> block = arena_->Allocate(m.bytes, slice);
      if (block.ok()) {
        std::unique_lock<std::mutex> lock(mu_);
        m.block = *block;
        m.holds_memory = true;
        base = block->data;
        break;
      }
      status = block.status();
    }
    if (!absl::IsDeadlineExceeded(status)) return status;
    std::unique_lock<std::mutex> lock(mu_);
    HMOE_RETURN_IF_ERROR(WaitLocked(
        lock, deadline, [] { return true; }, "loader waiting for device memory"));
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("streaming weights: no device memory for ", ModuleName(m.id), " within ",
                       absl::FormatDuration(options_.stall_timeout), " (stall_timeout)"));
    }
  }
  const absl::Time copy_start = absl::Now();
  auto* dst = static_cast<std::byte*>(base);
  for (const Piece& piece : m.pieces) {
    HMOE_RETURN_IF_ERROR(
        device_->CopyToDevice(*loader_stream_, dst + piece.offset, piece.src, piece.bytes));
  }
  m.views = m.host;
  size_t i = 0;
  VisitPointers(m.id.kind, m.views, [&](const void*& p, size_t) { p = dst + m.reloc[i++]; });
  HMOE_RETURN_IF_ERROR(m.on->Signal(*loader_stream_));
  // The copies are complete (timed; on a GPU this keeps one module in flight on the link).
  HMOE_RETURN_IF_ERROR(loader_stream_->Synchronize());
  const absl::Time end = absl::Now();
  std::unique_lock<std::mutex> lock(mu_);
  stats_.loader_memory_wait_seconds += absl::ToDoubleSeconds(copy_start - start);
  stats_.copy_seconds += absl::ToDoubleSeconds(end - copy_start);
  stats_.bytes_streamed += static_cast<int64_t>(m.copy_bytes);
  ++stats_.modules_loaded;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------- unloader

void StreamingWeights::UnloaderLoop() {
  while (true) {
    uint64_t seq = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || (!aborting_ && !unload_queue_.empty()); });
      if (stopping_) return;
      seq = unload_queue_.front();
      unload_queue_.pop_front();
      unloader_busy_ = true;
    }
    const absl::Status s = Unload(seq);
    {
      std::unique_lock<std::mutex> lock(mu_);
      unloader_busy_ = false;
      if (s.ok()) {
        slot_next_seq_[seq % modules_.size()] = seq + modules_.size();
        ++unloaded_;
      } else if (!aborting_ && error_.ok()) {
        error_ = s;
      }
    }
    cv_.notify_all();
  }
}

absl::Status StreamingWeights::Unload(uint64_t seq) {
  Module& m = *modules_[seq % modules_.size()];
  const absl::Time deadline = absl::Now() + options_.stall_timeout;
  // The model's work on the module must be complete on the device before its memory is reused.
  while (true) {
    const absl::Status s = m.off->WaitHost(std::min(deadline, absl::Now() + kPoll));
    if (s.ok()) break;
    if (!absl::IsDeadlineExceeded(s)) return s;
    std::unique_lock<std::mutex> lock(mu_);
    HMOE_RETURN_IF_ERROR(WaitLocked(
        lock, deadline, [] { return true; }, "unloader waiting for a release"));
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    HMOE_RETURN_IF_ERROR(FreeSlotMemory(m));
  }
  m.on->Reset();
  m.off->Reset();
  return absl::OkStatus();
}

}  // namespace hmoe

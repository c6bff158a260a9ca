#pragma once

// StreamingWeights: the weight provider of stream-loading prefill (SLP, paper §3.1). The engine's
// ordinary forward pass (ExpertPlacement::kDevice) runs on the attention device while the weights
// stream in from host memory (weightd's mapping or a checkpoint) just ahead of their use:
//
//   loader thread     stages module i: takes device memory (an experts ring-buffer slot for a
//                     routed expert, a block of the budgeted StreamArena for everything else),
//                     copies the module's tensors on its own stream, signals ON(i)
//   model thread      the engine: Acquire(i) waits for ON(i) (host side, then orders its stream
//                     after the copy), runs the module, Release(i) signals OFF(i) on its stream
//   unloader thread   waits for OFF(i) (and the device work before it), frees or recycles the
//                     memory. Nothing is ever copied back: the host copy is authoritative.
//
// ON and OFF are common/device EventTuples (device event + host event), one pair per module of a
// pass. A "pass" is one engine step: every module once, in the engine's order (weights.h):
// per layer attention(l), then dense_mlp(l), or shared_experts(l) and expert(l, e) for every
// loaded e in increasing id; then head. A prompt longer than one step takes several passes and
// the loader streams the modules once per pass, running ahead into the next pass while the
// current one finishes; the head only in the passes that need it (HeadStreaming).
//
// Memory: the device holds at most ring_bytes() (the experts ring, allocated once) +
// budget_bytes() (the arena, allocated once) for weights; everything else on the device is the
// caller's (activations, KV cache). The loader blocks while the next module does not fit (ring
// slot not yet recycled, arena full) until the unloader frees space; every module fits on its own
// (checked at Create), so the pipeline always makes progress.
//
// Module views are built once at Create from an in-place ResidentWeights over the same source
// (so SLP computes with exactly the tensors, and the same absorbed W_UK^T, as resident-weights
// inference) and relocated into device memory at each load.
//
// Threads: Acquire/Release/BeginPrefill/EndPrefill/SetRingSlots/SetLoadedExperts are called by
// one model thread (the engine's), and so are the getters of the plan (modules_per_pass,
// loaded_experts_per_layer, bytes_per_pass, schedule, ...); ring_slots, ring_slot_bytes,
// ring_bytes and budget_bytes may be called from any thread. The loader and unloader are this
// object's own threads.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "common/device/device.h"
#include "common/device/ring_buffer.h"
#include "common/engine/stream_arena.h"
#include "common/engine/weights.h"
#include "common/model/model_config.h"
#include "common/model/tensor.h"

namespace hmoe {

// The paper's "fixed budget of about 1 GB" for the non-expert tensors.
inline constexpr size_t kDefaultStreamBudgetBytes = size_t{1} << 30;
// On a host-memory device (CpuDevice) the default budget holds the non-expert modules of this many
// layers (the one computing and the next ones staged) instead: the arena is process memory, and
// its first-in first-out allocation cycles through all of it, so a 1 GiB arena ends up resident.
inline constexpr int64_t kHostStreamLookaheadLayers = 3;

// The streaming budget when none is given (StreamingWeightsOptions::budget_bytes == 0):
//   device memory (GPU): max(kDefaultStreamBudgetBytes, largest_module_bytes);
//   host memory (CpuDevice): max(largest_module_bytes, min(kDefaultStreamBudgetBytes,
//                                kHostStreamLookaheadLayers * largest_layer_bytes)),
// where largest_module_bytes is the largest non-expert module (often the head) and
// largest_layer_bytes the most non-expert bytes of one layer (attention + dense MLP or shared
// experts).
size_t DefaultStreamBudgetBytes(bool host_memory_device, size_t largest_module_bytes,
                                size_t largest_layer_bytes);

struct StreamingWeightsOptions {
  // Experts ring length in slots (>= 1). 0: the number of routed experts loaded per layer (the
  // paper's short-prompt setting: the whole next layer may be staged ahead).
  int64_t ring_slots = 0;
  // Device bytes for the modules outside the ring (attention blocks, dense MLPs, shared experts,
  // the head). Every such module must fit on its own: InvalidArgument at Create otherwise. 0:
  // DefaultStreamBudgetBytes (1 GiB on a GPU, a few layers' worth on the CPU device).
  size_t budget_bytes = kDefaultStreamBudgetBytes;
  // Which routed experts this provider streams (a DSLP rank: its own); null: all. The engine's
  // Acquire of an expert that is not loaded fails with FailedPrecondition.
  std::function<bool(int64_t layer, int64_t expert)> load_expert = nullptr;
  // A pipeline wait longer than this (the model for a module, the loader for memory, the
  // unloader for a module's release) fails the prefill with DeadlineExceeded instead of hanging.
  absl::Duration stall_timeout = absl::Minutes(10);
};

// Which passes of a prefill stream the head (final norm + lm_head). The engine acquires the head
// in every step, so the schedule stays fixed, but reads it only when a sequence of the step wants
// logits: only the last step of a chunked prompt does, and a DSLP rank other than 0 never does.
// Where the head is not streamed, Acquire returns it with null tensors (no copy, no device
// memory), and an engine step that wants logits then fails with FailedPrecondition.
enum class HeadStreaming {
  kEveryPass,  // every pass (a caller that may want logits from any step)
  kLastPass,   // only the last pass (SLP: the prompt's last step samples the first token)
  kNever,      // no pass (a DSLP rank > 0)
};

// What one prefill's streaming did.
struct StreamingStats {
  int64_t passes = 0;
  int64_t modules_loaded = 0;
  // Head loads skipped by HeadStreaming (not counted in modules_loaded or bytes_streamed).
  int64_t heads_skipped = 0;
  int64_t bytes_streamed = 0;
  // Loader: time inside the copies (the host-to-device link busy), and time blocked waiting for
  // device memory (ring slot or arena space).
  double copy_seconds = 0;
  double loader_memory_wait_seconds = 0;
  // Model thread: time blocked in Acquire waiting for modules to arrive (copy time not hidden).
  double load_wait_seconds = 0;
  // BeginPrefill to the end of EndPrefill.
  double wall_seconds = 0;
  // Highest arena bytes and ring slots in use.
  size_t arena_peak_bytes = 0;
  int64_t ring_peak_slots = 0;

  // The fraction of copy time hidden behind compute: 1 - load_wait / copy (clamped to [0, 1]).
  double hidden_fraction() const;
};

class StreamingWeights final : public WeightProvider {
 public:
  // Validates the model's tensors (as ResidentWeights::Create), plans every module, allocates
  // the ring (ring_slots slots of the largest routed expert) and the arena from `device`, and
  // starts the loader and unloader threads. `source` and `device` must outlive the provider.
  // InvalidArgument for bad options or a module larger than budget_bytes (the message names the
  // module, its size and the budget); ResourceExhausted when the ring or arena does not fit the
  // device; the device's and ResidentWeights' errors otherwise.
  static absl::StatusOr<std::unique_ptr<StreamingWeights>> Create(
      const ModelConfig& config, const WeightSource& source, Device& device,
      const StreamingWeightsOptions& options = {});
  // Aborts a prefill still running, stops the threads.
  ~StreamingWeights() override;
  StreamingWeights(const StreamingWeights&) = delete;
  StreamingWeights& operator=(const StreamingWeights&) = delete;

  // WeightProvider. host_moe() is null: experts run on the device (ExpertPlacement::kDevice).
  const TensorView& host_embedding() const override;
  const HostMoeWeights* host_moe(int64_t layer) const override;
  // Modules must be acquired in the schedule's order (FailedPrecondition naming the expected
  // module otherwise, or when no prefill is running or all its passes are used up). Waits for
  // the module's ON tuple; DeadlineExceeded after stall_timeout; the loader's error if it failed.
  absl::StatusOr<const ModuleWeights*> Acquire(const ModuleId& module, Stream& stream) override;
  // Signals the module's OFF tuple on `stream`. FailedPrecondition when it is not acquired.
  absl::Status Release(const ModuleId& module, Stream& stream) override;

  // Starts streaming `num_passes` (>= 1) passes, the head in those `head` says.
  // FailedPrecondition while a prefill runs.
  absl::Status BeginPrefill(int64_t num_passes, HeadStreaming head = HeadStreaming::kEveryPass);
  // Ends the prefill. Normally (abort false) after the engine ran all passes: waits until every
  // module was unloaded and returns the stats; an error of the loader or unloader, or modules
  // not acquired or not released, is returned (the pipeline is then cleaned up as for an
  // abort). abort true (after a failed or cancelled step; the caller has synchronized its
  // stream): stops the loader and unloader where they are and frees everything. Either way the
  // provider is ready for the next BeginPrefill afterwards. FailedPrecondition when no prefill
  // runs.
  absl::StatusOr<StreamingStats> EndPrefill(bool abort = false);

  // Re-allocates the experts ring with `slots` slots (>= 1; 0: loaded experts per layer).
  // FailedPrecondition while a prefill runs; the device's ResourceExhausted (the ring is then
  // gone until a later call succeeds).
  absl::Status SetRingSlots(int64_t slots);

  // Changes which routed experts are streamed (StreamingWeightsOptions::load_expert; null: all),
  // e.g. when a prefill worker becomes another rank of a DSLP group, and re-plans the schedule.
  // The ring and the arena stay (the ring is re-allocated with its number of slots only if a
  // newly streamed expert is larger than a slot). FailedPrecondition while a prefill runs;
  // errors of planning (the provider then streams what it streamed before).
  absl::Status SetLoadedExperts(std::function<bool(int64_t layer, int64_t expert)> load_expert);

  int64_t ring_slots() const;
  size_t ring_slot_bytes() const;
  // Device bytes of the experts ring (DeviceRingBuffer::footprint_bytes; 0 without one).
  size_t ring_bytes() const;
  size_t budget_bytes() const { return arena_->capacity_bytes(); }
  // Modules per pass, and the routed experts loaded per layer (the most over the layers).
  int64_t modules_per_pass() const { return static_cast<int64_t>(modules_.size()); }
  int64_t loaded_experts_per_layer() const { return loaded_experts_per_layer_; }
  // The largest module outside the ring (the smallest budget that works).
  size_t largest_budget_module_bytes() const { return largest_budget_module_; }
  // The most non-expert module bytes of one layer.
  size_t largest_layer_budget_bytes() const { return largest_layer_budget_; }
  // Weight bytes one pass streams (the head included), and the head's share of them.
  size_t bytes_per_pass() const { return bytes_per_pass_; }
  size_t head_bytes() const { return head_bytes_; }
  // The module order of one pass.
  std::vector<ModuleId> schedule() const;

 private:
  struct Piece;
  struct Module;
  StreamingWeights(const StreamingWeightsOptions& options, Device* device);
  // Builds modules_ for config_ and load_expert_ (the fields derived from it included).
  absl::Status Plan();
  void LoaderLoop();
  void UnloaderLoop();
  // Loads sequence number `seq` (loader thread).
  absl::Status Load(uint64_t seq);
  // Unloads `seq` (unloader thread).
  absl::Status Unload(uint64_t seq);
  // Frees the memory `m` holds, if any (mu_ held).
  absl::Status FreeSlotMemory(Module& m);
  // Stops the threads' current work, frees every module's memory and resets the tuples.
  void CleanUp();
  // Blocks until pred() (mu_ held via `lock`), the prefill failed or aborted, or `deadline`.
  absl::Status WaitLocked(std::unique_lock<std::mutex>& lock, absl::Time deadline,
                          const std::function<bool()>& pred, const char* what);

  const StreamingWeightsOptions options_;
  Device* const device_;
  ModelConfig config_;
  // Which routed experts are streamed (options_.load_expert until SetLoadedExperts). Changed only
  // while no prefill runs and the loader and unloader are idle.
  std::function<bool(int64_t layer, int64_t expert)> load_expert_;
  std::unique_ptr<Device> host_device_;           // a CpuDevice for host_ (nothing is allocated)
  std::unique_ptr<ResidentWeights> host_;         // host views of every module (in place)
  std::vector<std::unique_ptr<Module>> modules_;  // one per module of a pass, schedule order
  int64_t loaded_experts_per_layer_ = 0;
  size_t ring_slot_bytes_ = 0;
  size_t largest_budget_module_ = 0;
  size_t largest_layer_budget_ = 0;
  size_t bytes_per_pass_ = 0;
  size_t head_bytes_ = 0;
  std::unique_ptr<StreamArena> arena_;
  std::unique_ptr<Stream> loader_stream_;

  // Model-thread state (Acquire/Release/BeginPrefill/EndPrefill).
  uint64_t model_seq_ = 0;      // the next sequence number to acquire
  std::vector<uint64_t> held_;  // acquired, not yet released
  absl::Time prefill_start_;

  // std::mutex, not absl::Mutex: see common/device/sync_internal.h. Guards everything below and
  // the memory fields of the modules.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<DeviceRingBuffer> ring_;
  bool running_ = false;   // between BeginPrefill and EndPrefill
  bool aborting_ = false;  // EndPrefill is stopping the threads
  bool stopping_ = false;  // destructor
  uint64_t total_ = 0;     // modules of the running prefill (passes * modules_per_pass)
  HeadStreaming head_ = HeadStreaming::kEveryPass;  // of the running prefill
  uint64_t loaded_ = 0;                             // the loader's next sequence number
  uint64_t unloaded_ = 0;                           // unloads done
  std::deque<uint64_t> unload_queue_;               // released by the model, to unload
  std::vector<uint64_t> slot_next_seq_;  // per module: the sequence number it serves next
  bool loader_busy_ = false;             // the loader is inside Load
  bool unloader_busy_ = false;           // the unloader is inside Unload
  absl::Status error_;
  int64_t ring_in_use_ = 0;
  StreamingStats stats_;

  std::jthread loader_;  // last: start after everything above exists
  std::jthread unloader_;
};

}  // namespace hmoe

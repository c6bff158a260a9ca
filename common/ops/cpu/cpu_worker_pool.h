#pragma once

// A pool of CPU worker threads grouped by NUMA node, for the routed experts of the decode path.
//
// The pool's threads are split into `num_nodes` groups ("nodes") of `threads_per_node` threads.
// On a multi-socket machine each group is pinned to the CPUs of one NUMA node, and the MoE
// executor gives each node only its own slice of every expert. A machine with one node can still
// be split into several (virtual) nodes, mapped round-robin onto the real ones, so the NUMA split
// is testable anywhere.
//
// Run(job) is the pool's one operation: it runs job(thread) on every thread and returns when all
// are done, i.e. it is one global barrier. Thread 0 is the caller's own thread (it is not pinned
// by the pool); threads 1..n-1 are the pool's. Between jobs the workers spin for a short while
// (new jobs usually follow quickly: two per MoE layer), then sleep on a futex.

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace hmoe {

struct CpuWorkerPoolOptions {
  // Node groups. 0: one per NUMA node of the machine (1 without libnuma support). A value above
  // the machine's node count makes virtual nodes, mapped round-robin onto the real ones.
  int num_nodes = 0;
  // Threads per node, the caller's thread counting as node 0's first. 0: the CPUs of node 0
  // available to this process, divided among the virtual nodes sharing a real node (at least 1).
  int threads_per_node = 0;
  // Pin each pool thread to one CPU of its node (round-robin over the node's CPUs).
  bool pin_threads = true;
  // How long an idle worker spins waiting for the next job before it sleeps.
  absl::Duration spin = absl::Microseconds(100);
};

class CpuWorkerPool {
 public:
  // InvalidArgument for negative counts; Internal when a thread cannot be started.
  static absl::StatusOr<std::unique_ptr<CpuWorkerPool>> Create(const CpuWorkerPoolOptions& options);

  // Stops and joins the workers. Must not race with Run().
  ~CpuWorkerPool();

  CpuWorkerPool(const CpuWorkerPool&) = delete;
  CpuWorkerPool& operator=(const CpuWorkerPool&) = delete;

  int num_threads() const { return num_nodes_ * threads_per_node_; }
  int num_nodes() const { return num_nodes_; }
  int threads_per_node() const { return threads_per_node_; }
  // The node group of `thread` (0..num_threads()-1) and its index within the group.
  int NodeOfThread(int thread) const { return thread / threads_per_node_; }
  int IndexInNode(int thread) const { return thread % threads_per_node_; }
  // The machine's NUMA node behind (possibly virtual) node `node`, for memory placement.
  int RealNode(int node) const { return real_nodes_[node % real_nodes_.size()]; }

  // Runs job(thread) for thread = 0..num_threads()-1 concurrently, job(0) on the calling thread,
  // and returns after every call has returned. One Run at a time: calls must not overlap (the
  // pool checks). The job must not call Run.
  void Run(absl::FunctionRef<void(int thread)> job);

 private:
  CpuWorkerPool(int num_nodes, int threads_per_node, std::vector<int> real_nodes,
                absl::Duration spin);
  void WorkerLoop(int thread, std::vector<int> cpus);

  const int num_nodes_;
  const int threads_per_node_;
  const std::vector<int> real_nodes_;
  const int64_t spin_ns_;

  // The job of the current generation; written by Run before it bumps generation_.
  const absl::FunctionRef<void(int)>* job_ = nullptr;
  // Bumped (release) by Run to start a job; workers acquire it and then read job_.
  std::atomic<uint32_t> generation_{0};
  // Workers still running the current job; each decrements it (release) when done and Run
  // acquires it, so the job's writes are visible to the caller after Run.
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> running_{false};  // Run in progress (misuse check only)
  std::vector<std::jthread> threads_;
};

}  // namespace hmoe

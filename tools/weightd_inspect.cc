// hmoe-weightd-inspect: what a weightd instance holds in shared memory.
//
//   hmoe-weightd-inspect --instance NAME            summary, segments, memory per NUMA node
//   hmoe-weightd-inspect --instance NAME --tensors  ... plus every tensor and its parts
//   hmoe-weightd-inspect --instance NAME --verify --model DIR
//        compares every tensor (and every NUMA part) byte for byte with the checkpoint
//   hmoe-weightd-inspect --instance NAME --status   weightd's own status over its unix socket
//   --touch reads every byte of every segment (faults the pages into this process);
//   --hold stays attached until SIGTERM/SIGINT, then re-runs --verify on the same mappings;
//   --wait-ready-seconds N retries the attach until the store is ready;
//   --remove removes the instance's segments when no weightd owns them any more.
//
// Works without weightd running (the segments persist). Prints "attach_ms=<ms>" for the attach.
// Exit code 0 on success, 1 on any error or mismatch, 2 on bad flags.

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include <grpcpp/grpcpp.h>

#include "common/base/flags.h"
#include "common/base/logging.h"
#include "common/model/checkpoint.h"
#include "common/model/gguf_source.h"
#include "common/shm/control_segment.h"
#include "common/shm/data_segment.h"
#include "common/shm/numa_placement.h"
#include "common/shm/shm_names.h"
#include "common/shm/weight_store.h"
#include "proto/weightd.grpc.pb.h"

ABSL_FLAG(std::string, instance, "default", "weightd instance name");
ABSL_FLAG(bool, tensors, false, "list every tensor with its placement and parts");
ABSL_FLAG(bool, verify, false, "compare every tensor byte with the checkpoint given by --model");
ABSL_FLAG(std::string, model, "", "checkpoint directory or GGUF file (*.gguf) for --verify");
ABSL_FLAG(bool, touch, false, "read every byte of every segment");
ABSL_FLAG(bool, hold, false, "stay attached until SIGTERM/SIGINT (then --verify again)");
ABSL_FLAG(bool, status, false, "print weightd's status from its gRPC service");
ABSL_FLAG(std::string, socket, "", "weightd's socket for --status (default: from --instance)");
ABSL_FLAG(double, wait_ready_seconds, 0, "retry attaching for this long while not ready");
ABSL_FLAG(bool, remove, false,
          "remove the instance's segments (refused while its weightd is running)");

namespace hmoe {
namespace {

using shm::TensorEntry;
using shm::TensorPartView;
using shm::WeightStore;

std::string Human(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (uint64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / (1 << 30));
  if (bytes >= (uint64_t{1} << 20)) return absl::StrFormat("%.1f MiB", b / (1 << 20));
  if (bytes >= (uint64_t{1} << 10)) return absl::StrFormat("%.1f KiB", b / (1 << 10));
  return absl::StrCat(bytes, " B");
}

std::string Shape(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

void PrintSummary(const WeightStore& store) {
  const shm::Manifest& m = store.manifest();
  const shm::ControlHeader& h = store.control_header();
  const int owner = h.owner_pid;
  const bool alive = owner > 0 && ::kill(owner, 0) == 0;
  std::printf("instance %s: generation %llu, model %s\n", store.instance().c_str(),
              static_cast<unsigned long long>(m.generation), m.identity.ToString().c_str());
  std::printf("  model dir %s\n", m.model_dir.c_str());
  std::printf("  %zu tensors, %s; %u expert slice(s), dense %s\n", m.tensors.size(),
              Human(m.total_tensor_bytes).c_str(), m.num_slices,
              shm::DensePolicyName(m.dense_policy));
  std::printf("  loaded by pid %d; owner pid %d (%s); adopted %u time(s)\n", h.creator_pid, owner,
              owner == 0 ? "none" : (alive ? "running" : "gone"), h.adopt_count);
  std::printf("segments:\n");
  std::printf("  %-3s %-13s %-5s %-4s %-11s %10s %10s %5s %6s  %s\n", "#", "role", "slice", "node",
              "backing", "size", "used", "mode", "nattch", "location");
  uint64_t total = 0;
  for (const WeightStore::Segment& s : store.segments()) {
    absl::StatusOr<shm::DataSegment::Stat> st = shm::DataSegment::StatSegment(s.handle);
    total += s.bytes.size();
    std::printf("  %-3u %-13s %-5d %-4d %-11s %10s %10s %5s %6s  %s\n", s.layout.index,
                shm::SegmentRoleName(s.layout.role), s.layout.slice, s.layout.numa_node,
                shm::PageBackingName(s.backing), Human(s.bytes.size()).c_str(),
                Human(s.layout.used_bytes).c_str(),
                st.ok() ? absl::StrFormat("%04o", st->mode).c_str() : "gone",
                st.ok() && st->num_attached >= 0 ? absl::StrCat(st->num_attached).c_str() : "-",
                s.handle.ToString().c_str());
  }
  std::printf("  total %s of shared memory for %s of tensors\n", Human(total).c_str(),
              Human(m.total_tensor_bytes).c_str());
}

void PrintMemoryPerNode(const WeightStore& store) {
  std::map<int, uint64_t> per_node;
  for (const WeightStore::Segment& s : store.segments()) {
    // Only the used part: reading an untouched shmem page would allocate it.
    const std::span<const std::byte> used =
        s.bytes.first(std::min<size_t>(s.bytes.size(), (s.layout.used_bytes + 4095) / 4096 * 4096));
    const uint64_t stride = std::max<uint64_t>(4096, used.size() / 16384 / 4096 * 4096);
    for (const auto& [node, bytes] : shm::BytesPerNode(used, stride)) per_node[node] += bytes;
  }
  std::printf("memory per NUMA node (used bytes, sampled):\n");
  for (const auto& [node, bytes] : per_node) {
    std::printf("  node %s: %s\n", node < 0 ? "?" : absl::StrCat(node).c_str(),
                Human(bytes).c_str());
  }
}

void PrintTensors(const WeightStore& store) {
  std::printf("tensors:\n");
  for (const TensorEntry& t : store.manifest().tensors) {
    std::printf("  %s %s %s %s seg %u @%llu%s%s\n", t.name.c_str(),
                std::string(DTypeName(t.dtype)).c_str(), Shape(t.shape).c_str(),
                shm::PlacementName(t.placement), t.segment,
                static_cast<unsigned long long>(t.offset), t.contiguous ? "" : " (split)",
                t.scale_name.empty() ? "" : (" scale " + t.scale_name).c_str());
    if (t.parts.size() > 1 || t.parts[0].split_dim >= 0) {
      for (const shm::TensorPart& p : t.parts) {
        std::printf("      part %u node %d seg %u @%llu %s dim %d [%lld, %lld)\n", p.slice,
                    p.numa_node, p.segment, static_cast<unsigned long long>(p.offset),
                    Shape(p.shape).c_str(), p.split_dim, static_cast<long long>(p.begin),
                    static_cast<long long>(p.end));
      }
    }
  }
}

// Compares one part with the matching bytes of the checkpoint tensor.
bool PartMatches(const TensorView& want, const TensorPartView& p) {
  const size_t esize = DTypeSize(want.dtype);
  if (p.part.split_dim < 0) {
    return p.view.size_bytes == want.size_bytes &&
           std::memcmp(p.view.data, want.data, want.size_bytes) == 0;
  }
  const int64_t rows = want.shape[0], cols = want.shape[1];
  if (p.part.split_dim == 0) {
    const size_t off = static_cast<size_t>(p.part.begin * cols) * esize;
    return off + p.view.size_bytes <= want.size_bytes &&
           std::memcmp(p.view.data, want.data + off, p.view.size_bytes) == 0;
  }
  const size_t width = static_cast<size_t>(p.part.end - p.part.begin) * esize;
  for (int64_t r = 0; r < rows; ++r) {
    if (std::memcmp(p.view.data + static_cast<size_t>(r) * width,
                    want.data + static_cast<size_t>(r * cols + p.part.begin) * esize, width) != 0) {
      return false;
    }
  }
  return true;
}

bool Verify(const WeightStore& store, const std::string& model_dir) {
  // A checkpoint directory, or a GGUF file (its tensors as weightd stores them: GGUF encoding,
  // kv_b_proj dequantized; docs/gguf.md).
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<GgufCheckpoint> gguf;
  absl::Status opened;
  if (IsGgufPath(model_dir)) {
    absl::StatusOr<std::unique_ptr<GgufCheckpoint>> g = GgufCheckpoint::Open(model_dir);
    if (g.ok()) gguf = *std::move(g);
    opened = g.status();
  } else {
    absl::StatusOr<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(model_dir);
    if (c.ok()) checkpoint = *std::move(c);
    opened = c.status();
  }
  if (!opened.ok()) {
    std::printf("verify: FAILED: %s\n", opened.ToString().c_str());
    return false;
  }
  const WeightSource* ckpt =
      checkpoint != nullptr ? static_cast<const WeightSource*>(checkpoint.get()) : gguf.get();
  std::vector<shm::TensorIndexEntry> index;
  for (const std::string& name : ckpt->TensorNames()) {
    absl::StatusOr<TensorView> v = ckpt->GetTensor(name);
    if (!v.ok()) continue;
    index.push_back(shm::TensorIndexEntry{name, v->dtype, v->shape, v->size_bytes});
  }
  const shm::ModelIdentity identity = shm::ComputeModelIdentity(
      checkpoint != nullptr ? checkpoint->config_json() : gguf->config_json(), std::move(index));
  if (identity != store.identity()) {
    std::printf("verify: FAILED: checkpoint is model %s, the store holds %s\n",
                identity.ToString().c_str(), store.identity().ToString().c_str());
    return false;
  }
  if (ckpt->TensorNames() != store.TensorNames()) {
    std::printf("verify: FAILED: tensor names differ\n");
    return false;
  }
  uint64_t bytes = 0, parts = 0, mismatches = 0;
  for (const std::string& name : ckpt->TensorNames()) {
    absl::StatusOr<TensorView> want = ckpt->GetTensor(name);
    const TensorEntry* e = store.manifest().Find(name);
    absl::StatusOr<std::vector<TensorPartView>> got = store.GetParts(name);
    if (!want.ok() || e == nullptr || !got.ok()) {
      std::printf("verify: FAILED: %s missing\n", name.c_str());
      return false;
    }
    bool ok = e->dtype == want->dtype && e->shape == want->shape;
    if (e->contiguous) {
      absl::StatusOr<TensorView> whole = store.GetTensor(name);
      ok = ok && whole.ok() && whole->size_bytes == want->size_bytes &&
           std::memcmp(whole->data, want->data, want->size_bytes) == 0;
    }
    for (const TensorPartView& p : *got) {
      ok = ok && PartMatches(*want, p);
      ++parts;
    }
    bytes += want->size_bytes;
    if (!ok && ++mismatches <= 10) std::printf("verify: MISMATCH %s\n", name.c_str());
  }
  if (mismatches > 0) {
    std::printf("verify: FAILED: %llu of %zu tensors differ\n",
                static_cast<unsigned long long>(mismatches), ckpt->TensorNames().size());
    return false;
  }
  std::printf("verify: OK: %zu tensors, %llu parts, %s byte-equal to %s\n",
              ckpt->TensorNames().size(), static_cast<unsigned long long>(parts),
              Human(bytes).c_str(), model_dir.c_str());
  return true;
}

void Touch(const WeightStore& store) {
  const auto start = std::chrono::steady_clock::now();
  uint64_t sum = 0, bytes = 0;
  for (const WeightStore::Segment& s : store.segments()) {
    const auto* p = reinterpret_cast<const uint64_t*>(s.bytes.data());
    const size_t n = s.layout.used_bytes / 8;
    for (size_t i = 0; i < n; ++i) sum += p[i];
    bytes += n * 8;
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("touched %s in %.1f ms (checksum %016llx)\n", Human(bytes).c_str(), ms,
              static_cast<unsigned long long>(sum));
}

int PrintStatus(const std::string& instance) {
  std::string path = absl::GetFlag(FLAGS_socket);
  if (path.empty()) path = shm::DefaultSocketPath(instance);
  auto channel = grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials());
  auto stub = weightd::v1::WeightdService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  weightd::v1::WeightdStatus status;
  const grpc::Status s = stub->GetStatus(&ctx, weightd::v1::GetStatusRequest(), &status);
  if (!s.ok()) {
    std::printf("status: weightd at unix:%s: %s\n", path.c_str(), s.error_message().c_str());
    return 1;
  }
  std::printf(
      "weightd pid %d: %s, %s, generation %llu, startup %.3f s, load %.3f s, "
      "%llu bytes read from the checkpoint\n",
      status.pid(), weightd::v1::ServingState_Name(status.state()).c_str(),
      status.adopted() ? "adopted" : "loaded", static_cast<unsigned long long>(status.generation()),
      status.startup_seconds(), status.load_seconds(),
      static_cast<unsigned long long>(status.bytes_read_from_checkpoint()));
  return 0;
}

int Remove(const std::string& instance) {
  {
    absl::StatusOr<shm::ControlSegment> control = shm::ControlSegment::OpenReadOnly(instance);
    if (!control.ok()) {
      std::fprintf(stderr, "remove %s: %s\n", instance.c_str(),
                   control.status().ToString().c_str());
      return 1;
    }
    const int owner = control->LoadOwnerPid();
    if (owner > 0 && ::kill(owner, 0) == 0) {
      std::fprintf(stderr, "remove %s: weightd pid %d still serves it; stop it first\n",
                   instance.c_str(), owner);
      return 1;
    }
  }
  const absl::Status s = shm::RemoveInstance(instance);
  if (!s.ok()) {
    std::fprintf(stderr, "remove %s: %s\n", instance.c_str(), s.ToString().c_str());
    return 1;
  }
  std::printf("removed the segments of instance %s\n", instance.c_str());
  return 0;
}

int Run() {
  const std::string instance = absl::GetFlag(FLAGS_instance);
  const bool verify = absl::GetFlag(FLAGS_verify);
  const std::string model = absl::GetFlag(FLAGS_model);
  if (verify && model.empty()) {
    std::fprintf(stderr, "--verify needs --model DIR\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_status) && PrintStatus(instance) != 0) return 1;
  if (absl::GetFlag(FLAGS_remove)) return Remove(instance);

  // Block the stop signals before anything else, so --hold cannot miss one.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(absl::GetFlag(FLAGS_wait_ready_seconds));
  absl::StatusOr<std::unique_ptr<WeightStore>> store;
  double attach_ms = 0;
  while (true) {
    const auto start = std::chrono::steady_clock::now();
    store = WeightStore::Attach(instance);
    attach_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (store.ok() || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!store.ok()) {
    std::fprintf(stderr, "attach %s: %s\n", instance.c_str(), store.status().ToString().c_str());
    return 1;
  }
  std::printf("attach_ms=%.3f\n", attach_ms);
  PrintSummary(**store);
  PrintMemoryPerNode(**store);
  if (absl::GetFlag(FLAGS_tensors)) PrintTensors(**store);
  if (absl::GetFlag(FLAGS_touch)) Touch(**store);
  bool ok = true;
  if (verify) ok = Verify(**store, model);
  if (absl::GetFlag(FLAGS_hold)) {
    std::printf("holding (pid %d); SIGTERM to release\n", ::getpid());
    std::fflush(stdout);
    int sig = 0;
    sigwait(&signals, &sig);
    std::printf("released by signal %d\n", sig);
    if (verify) ok = Verify(**store, model) && ok;
  }
  std::fflush(stdout);
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) {
  std::vector<std::string> storage;
  std::vector<char*> args = hmoe::NormalizeFlagNames(argc, argv, storage);
  hmoe::SetUsage(
      "hmoe-weightd-inspect --instance NAME [--tensors] [--verify --model DIR] [--touch] [--hold] "
      "[--status]");
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  return hmoe::Run();
}

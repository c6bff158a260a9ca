// Linked into test binaries only in ThreadSanitizer builds (HMOE_SANITIZE=thread).
//
// Debian's libabsl_synchronization is not built with TSan, so TSan cannot see the happens-before
// edges absl::Mutex creates (its lock words and futex waits live in uninstrumented code) and
// reports every pair of accesses guarded by one absl::Mutex as a data race. This file interposes
// the exported absl::Mutex / absl::CondVar entry points (the executable's definitions win over
// the shared library's), calls the real ones through dlsym(RTLD_NEXT), and tells TSan about the
// synchronization: an unlock (or the start of a wait, which releases the mutex) is a release on
// the mutex's address, a lock (or the end of a wait) an acquire. Conditions are wrapped so that
// evaluating one, which absl may do on the thread releasing the mutex, first acquires. This gives
// TSan plain mutex semantics (no lock-order checking) without rebuilding abseil.

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/base/config.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace {

#define HMOE_TSAN_STR_(x) #x
#define HMOE_TSAN_STR(x) HMOE_TSAN_STR_(x)

// The Itanium-mangled name of absl::<inline namespace>::<rest>; `rest` starts after the
// namespace prefix (e.g. "5Mutex4LockEv").
std::string AbslSymbol(const char* rest) {
  const std::string ns = HMOE_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  return "_ZN4absl" + std::to_string(ns.size()) + ns + rest;
}

template <typename Fn>
Fn Real(const char* rest) {
  const std::string name = AbslSymbol(rest);
  void* p = ::dlsym(RTLD_NEXT, name.c_str());
  if (p == nullptr) {
    std::fprintf(stderr, "tsan_absl_annotations: %s not found in libabsl\n", name.c_str());
    std::abort();
  }
  return reinterpret_cast<Fn>(p);
}

// Evaluates the wrapped condition (absl does so with the mutex held, on the waiting thread or on
// the thread releasing the mutex) between an acquire and a release on the mutex, so what it reads
// is ordered with every critical section.
struct AcquiringCondition {
  const absl::Condition* cond;
  void* mu;
  bool operator()() const {
    __tsan_acquire(mu);
    const bool r = cond->Eval();
    __tsan_release(mu);
    return r;
  }
};

// absl's deadlock detector updates a shared graph (GraphCycles) under an internal spinlock that
// TSan cannot see either; with it off, no report comes from inside abseil. (TSan itself checks
// lock order for the mutexes it knows; these annotations are not among them.)
const bool kDeadlockDetectionOff = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

}  // namespace

// gRPC, protobuf and the rest of abseil are uninstrumented too: their internal synchronization
// (atomics, absl::Status reference counts) is invisible, so the memory functions TSan intercepts
// inside them (memcpy, new/delete) look racy. Ignore what those libraries do internally; our own
// code stays fully checked.
extern "C" const char* __tsan_default_suppressions() {
  // Each entry must match exactly one loaded library (TSan refuses ambiguous ones).
  return "called_from_lib:libgrpc.so\n"
         "called_from_lib:libgrpc++.so\n"
         "called_from_lib:libgpr.so\n"
         "called_from_lib:libupb.so\n"
         "called_from_lib:libprotobuf.so\n"
         "called_from_lib:libabsl_base.so\n"
         "called_from_lib:libabsl_spinlock_wait.so\n"
         "called_from_lib:libabsl_malloc_internal.so\n"
         "called_from_lib:libabsl_synchronization.so\n"
         "called_from_lib:libabsl_graphcycles_internal.so\n"
         "called_from_lib:libabsl_status.so\n"
         "called_from_lib:libabsl_statusor.so\n"
         "called_from_lib:libabsl_strings.so\n"
         "called_from_lib:libabsl_strings_internal.so\n"
         "called_from_lib:libabsl_str_format_internal.so\n"
         "called_from_lib:libabsl_cord.so\n"
         "called_from_lib:libabsl_cord_internal.so\n"
         "called_from_lib:libabsl_raw_hash_set.so\n"
         "called_from_lib:libabsl_hash.so\n"
         "called_from_lib:libabsl_time.so\n";
}

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  real(this);
  __tsan_acquire(this);
}

void Mutex::Unlock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  __tsan_release(this);
  real(this);
}

bool Mutex::TryLock() {
  static auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}

void Mutex::ReaderLock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  real(this);
  __tsan_acquire(this);
}

void Mutex::ReaderUnlock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  __tsan_release(this);
  real(this);
}

bool Mutex::ReaderTryLock() {
  static auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}

void Mutex::Await(const Condition& cond) {
  static auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex5AwaitERKNS0_9ConditionE");
  AcquiringCondition w{&cond, this};
  __tsan_release(this);
  real(this, Condition(&w));
  __tsan_acquire(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  AcquiringCondition w{&cond, this};
  __tsan_release(this);
  const bool r = real(this, Condition(&w), timeout);
  __tsan_acquire(this);
  return r;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  AcquiringCondition w{&cond, this};
  __tsan_release(this);
  const bool r = real(this, Condition(&w), deadline);
  __tsan_acquire(this);
  return r;
}

void Mutex::LockWhen(const Condition& cond) {
  static auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  AcquiringCondition w{&cond, this};
  real(this, Condition(&w));
  __tsan_acquire(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  AcquiringCondition w{&cond, this};
  const bool r = real(this, Condition(&w), timeout);
  __tsan_acquire(this);
  return r;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  AcquiringCondition w{&cond, this};
  const bool r = real(this, Condition(&w), deadline);
  __tsan_acquire(this);
  return r;
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  AcquiringCondition w{&cond, this};
  real(this, Condition(&w));
  __tsan_acquire(this);
}

void CondVar::Wait(Mutex* mu) {
  static auto real = Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  __tsan_release(mu);
  real(this, mu);
  __tsan_acquire(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static auto real = Real<bool (*)(CondVar*, Mutex*, Duration)>(
      "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_release(mu);
  const bool r = real(this, mu, timeout);
  __tsan_acquire(mu);
  return r;
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static auto real =
      Real<bool (*)(CondVar*, Mutex*, Time)>("7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  __tsan_release(mu);
  const bool r = real(this, mu, deadline);
  __tsan_acquire(mu);
  return r;
}

ABSL_NAMESPACE_END
}  // namespace absl

// ThreadSanitizer annotations for Debian's absl::Mutex, absl::CondVar,
// absl::Notification, absl::BlockingCounter and absl::Status.
//
// Debian's libabsl_synchronization is not built with -fsanitize=thread, so
// TSan cannot see its locks: every access guarded by an absl::Mutex would be
// reported as a race. Abseil annotates its own code for TSan
// (ABSL_TSAN_MUTEX_* in mutex.cc) only when it is compiled with it. This
// file does the same from outside: it defines the library's public entry
// points in the executable, which the dynamic linker prefers over the
// library's for every caller (cohort's code, gRPC's, and the library's own
// calls, which go through its PLT), tells TSan what each does, and calls the
// library's definition found with dlsym(RTLD_NEXT).
//
// Linked only into --config=tsan builds (tools/sanitizers/BUILD).
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

// The library's definition of the member function whose mangled name is
// `symbol`, as a plain function taking `this` first.
template <typename Fn>
Fn Real(const char* symbol) {
  void* fn = dlsym(RTLD_NEXT, symbol);
  if (fn == nullptr) {
    std::fprintf(stderr, "absl_tsan_annotations: %s not found: %s\n", symbol,
                 dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

#define REAL(ret, symbol, ...) \
  static const auto real = Real<ret (*)(__VA_ARGS__)>(symbol)

// Some entry points call others through the PLT (LockWhenWithTimeout calls
// LockWhenWithDeadline): only the outermost call on a thread annotates.
thread_local int depth = 0;

struct Nested {
  Nested() { ++depth; }
  ~Nested() { --depth; }
  Nested(const Nested&) = delete;
  Nested& operator=(const Nested&) = delete;
};

constexpr unsigned kRead = __tsan_mutex_read_lock;
constexpr unsigned kTry = __tsan_mutex_try_lock;
constexpr unsigned kTryFailed = __tsan_mutex_try_lock_failed;

// Around a call that acquires `mu` (in mode `flags`) and holds it on
// return if `acquired`.
template <typename Call>
auto Locking(void* mu, unsigned flags, Call call) {
  if (depth > 0) return call();
  Nested nested;
  __tsan_mutex_pre_lock(mu, flags);
  auto acquired = call();
  __tsan_mutex_post_lock(mu, acquired ? flags : flags | kTryFailed, 0);
  return acquired;
}

// Around a call that releases `mu`, held in mode `flags`. Accesses between
// pre and post (waiters' Conditions, which absl evaluates on the unlocking
// thread) are ignored, as in absl's own annotations.
template <typename Call>
void Unlocking(void* mu, unsigned flags, Call call) {
  if (depth > 0) return call();
  Nested nested;
  __tsan_mutex_pre_unlock(mu, flags);
  call();
  __tsan_mutex_post_unlock(mu, flags);
}

// Around a call that releases `mu` (held in mode `flags`), waits, and
// acquires it again before returning: absl's Await and CondVar::Wait.
template <typename Call>
auto Relocking(void* mu, unsigned flags, Call call) {
  if (depth > 0) return call();
  Nested nested;
  __tsan_mutex_pre_unlock(mu, flags);
  auto result = call();
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
  return result;
}

// The flags of the mutex a CondVar waits with: absl's CondVar works with
// either mode; cohort only waits holding the lock exclusively.
constexpr unsigned kCondVarMode = 0;

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  REAL(void, "_ZN4absl7debian35Mutex4LockEv", Mutex*);
  Locking(this, 0, [&] { return real(this), true; });
}

void Mutex::ReaderLock() {
  REAL(void, "_ZN4absl7debian35Mutex10ReaderLockEv", Mutex*);
  Locking(this, kRead, [&] { return real(this), true; });
}

bool Mutex::TryLock() {
  REAL(bool, "_ZN4absl7debian35Mutex7TryLockEv", Mutex*);
  return Locking(this, kTry, [&] { return real(this); });
}

bool Mutex::ReaderTryLock() {
  REAL(bool, "_ZN4absl7debian35Mutex13ReaderTryLockEv", Mutex*);
  return Locking(this, kRead | kTry, [&] { return real(this); });
}

void Mutex::Unlock() {
  REAL(void, "_ZN4absl7debian35Mutex6UnlockEv", Mutex*);
  Unlocking(this, 0, [&] { real(this); });
}

void Mutex::ReaderUnlock() {
  REAL(void, "_ZN4absl7debian35Mutex12ReaderUnlockEv", Mutex*);
  Unlocking(this, kRead, [&] { real(this); });
}

void Mutex::LockWhen(const Condition& cond) {
  REAL(void, "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE", Mutex*,
       const Condition&);
  Locking(this, 0, [&] { return real(this, cond), true; });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  REAL(void, "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE", Mutex*,
       const Condition&);
  Locking(this, kRead, [&] { return real(this, cond), true; });
}

// The *WithTimeout/*WithDeadline forms hold the lock on return whatever the
// condition's value.
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  REAL(bool,
       "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_"
       "8DurationE",
       Mutex*, const Condition&, Duration);
  bool result;
  Locking(this, 0, [&] { return result = real(this, cond, timeout), true; });
  return result;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  REAL(bool,
       "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_"
       "4TimeE",
       Mutex*, const Condition&, Time);
  bool result;
  Locking(this, 0, [&] { return result = real(this, cond, deadline), true; });
  return result;
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  REAL(bool,
       "_ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_"
       "8DurationE",
       Mutex*, const Condition&, Duration);
  bool result;
  Locking(this, kRead,
          [&] { return result = real(this, cond, timeout), true; });
  return result;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  REAL(
      bool,
      "_ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_"
      "4TimeE",
      Mutex*, const Condition&, Time);
  bool result;
  Locking(this, kRead,
          [&] { return result = real(this, cond, deadline), true; });
  return result;
}

void Mutex::Await(const Condition& cond) {
  REAL(void, "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE", Mutex*,
       const Condition&);
  Relocking(this, 0, [&] { return real(this, cond), true; });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  REAL(bool,
       "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_"
       "8DurationE",
       Mutex*, const Condition&, Duration);
  return Relocking(this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  REAL(bool,
       "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE",
       Mutex*, const Condition&, Time);
  return Relocking(this, 0, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  REAL(void, "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE", CondVar*, Mutex*);
  Relocking(mu, kCondVarMode, [&] { return real(this, mu), true; });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  REAL(bool,
       "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE",
       CondVar*, Mutex*, Duration);
  return Relocking(mu, kCondVarMode, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  REAL(bool,
       "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE",
       CondVar*, Mutex*, Time);
  return Relocking(mu, kCondVarMode, [&] { return real(this, mu, deadline); });
}

// Notification: Notify stores an atomic flag inside the library, and
// HasBeenNotified (inline, so instrumented) loads it with acquire order.
// Releasing on the flag's address lets that load, and the waits below,
// order what the notifier did before Notify.
namespace {
// Notification is {Mutex mutex_; std::atomic<bool> notified_yet_;}.
static_assert(sizeof(Mutex) == sizeof(void*));
void* NotifiedFlag(const Notification* n) {
  return const_cast<char*>(reinterpret_cast<const char*>(n) + sizeof(Mutex));
}
}  // namespace

void Notification::Notify() {
  REAL(void, "_ZN4absl7debian312Notification6NotifyEv", Notification*);
  __tsan_release(NotifiedFlag(this));
  real(this);
}

void Notification::WaitForNotification() const {
  REAL(void, "_ZNK4absl7debian312Notification19WaitForNotificationEv",
       const Notification*);
  real(this);
  __tsan_acquire(NotifiedFlag(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  REAL(bool,
       "_ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_"
       "8DurationE",
       const Notification*, Duration);
  bool notified = real(this, timeout);
  if (notified) __tsan_acquire(NotifiedFlag(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  REAL(bool,
       "_ZNK4absl7debian312Notification31WaitForNotificationWithDeadlineENS0_"
       "4TimeE",
       const Notification*, Time);
  bool notified = real(this, deadline);
  if (notified) __tsan_acquire(NotifiedFlag(this));
  return notified;
}

// BlockingCounter: only the last DecrementCount takes the lock, so the
// others' work reaches Wait through the counter's (invisible) atomic.
bool BlockingCounter::DecrementCount() {
  REAL(bool, "_ZN4absl7debian315BlockingCounter14DecrementCountEv",
       BlockingCounter*);
  __tsan_release(this);
  return real(this);
}

void BlockingCounter::Wait() {
  REAL(void, "_ZN4absl7debian315BlockingCounter4WaitEv", BlockingCounter*);
  real(this);
  __tsan_acquire(this);
}

// Status: a copied Status shares a heap rep whose count is decremented, and
// the rep deleted, inside the library. As for any reference count, each
// release happens before the delete.
void Status::UnrefNonInlined(uintptr_t rep) {
  REAL(void, "_ZN4absl7debian36Status15UnrefNonInlinedEm", uintptr_t);
  void* const key = reinterpret_cast<void*>(rep);
  __tsan_release(key);
  __tsan_acquire(key);
  real(rep);
}

ABSL_NAMESPACE_END
}  // namespace absl

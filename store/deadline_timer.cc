#include "store/deadline_timer.h"

#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"

namespace cohort::store {
namespace {

// The one timer thread, and the callbacks of every DeadlineTimer by time.
struct TimerThread {
  struct Entry {
    DeadlineTimer* owner;
    std::function<void()> fn;
  };

  TimerThread() {
    std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    mu.Lock();
    for (;;) {
      absl::Time next =
          queue.empty() ? absl::InfiniteFuture() : queue.begin()->first.first;
      if (absl::Now() < next) {
        // Wakes early when an earlier deadline is scheduled.
        auto earlier = [this, next]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
          return !queue.empty() && queue.begin()->first.first < next;
        };
        mu.AwaitWithDeadline(absl::Condition(&earlier), next);
        continue;
      }
      auto node = queue.extract(queue.begin());
      when.erase(node.key().second);
      running = node.mapped().owner;
      Forget(running, node.key().second);
      mu.Unlock();
      node.mapped().fn();
      mu.Lock();
      running = nullptr;
    }
  }

  void Forget(const DeadlineTimer* owner, DeadlineTimer::TimerId id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = by_owner.find(owner);
    if (it == by_owner.end()) return;
    it->second.erase(id);
    if (it->second.empty()) by_owner.erase(it);
  }

  absl::Mutex mu;
  std::map<std::pair<absl::Time, DeadlineTimer::TimerId>, Entry> queue
      ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<DeadlineTimer::TimerId, absl::Time> when
      ABSL_GUARDED_BY(mu);
  // Each timer's pending callbacks, so its destructor can drop them.
  absl::flat_hash_map<const DeadlineTimer*,
                      absl::flat_hash_set<DeadlineTimer::TimerId>>
      by_owner ABSL_GUARDED_BY(mu);
  DeadlineTimer::TimerId next_id ABSL_GUARDED_BY(mu) = 1;
  // The timer whose callback is running, if any.
  const DeadlineTimer* running ABSL_GUARDED_BY(mu) = nullptr;
};

TimerThread& Shared() {
  // Never destroyed: its thread may be waiting at exit.
  static TimerThread* const shared = new TimerThread;
  return *shared;
}

}  // namespace

DeadlineTimer::DeadlineTimer() { Shared(); }

DeadlineTimer::~DeadlineTimer() {
  TimerThread& t = Shared();
  absl::MutexLock lock(&t.mu);
  if (auto mine = t.by_owner.find(this); mine != t.by_owner.end()) {
    for (TimerId id : mine->second) {
      auto it = t.when.find(id);
      if (it == t.when.end()) continue;
      t.queue.erase(std::make_pair(it->second, id));
      t.when.erase(it);
    }
    t.by_owner.erase(mine);
  }
  auto not_running = [this, &t]() ABSL_SHARED_LOCKS_REQUIRED(t.mu) {
    return t.running != this;
  };
  t.mu.Await(absl::Condition(&not_running));
}

DeadlineTimer::TimerId DeadlineTimer::Schedule(absl::Time when,
                                               std::function<void()> fn) {
  TimerThread& t = Shared();
  absl::MutexLock lock(&t.mu);
  TimerId id = t.next_id++;
  t.queue.emplace(std::make_pair(when, id),
                  TimerThread::Entry{this, std::move(fn)});
  t.when.emplace(id, when);
  t.by_owner[this].insert(id);
  return id;
}

bool DeadlineTimer::Cancel(TimerId id) {
  TimerThread& t = Shared();
  absl::MutexLock lock(&t.mu);
  auto it = t.when.find(id);
  if (it == t.when.end()) return false;
  t.queue.erase(std::make_pair(it->second, id));
  t.when.erase(it);
  t.Forget(this, id);
  return true;
}

}  // namespace cohort::store

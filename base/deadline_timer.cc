#include "base/deadline_timer.h"

#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"

namespace cohort::base {

// The shared timer thread and the callbacks of every DeadlineTimer, by time.
struct DeadlineTimer::Shared {
  struct Entry {
    DeadlineTimer* owner;
    std::function<void()> fn;
  };

  Shared() : thread([this] { Loop(); }) {}

  // Joins the thread. REQUIRES: no DeadlineTimer uses this any more.
  ~Shared() {
    {
      absl::MutexLock lock(&mu);
      stopping = true;
    }
    thread.join();
  }

  void Loop() {
    mu.Lock();
    while (!stopping) {
      absl::Time next =
          queue.empty() ? absl::InfiniteFuture() : queue.begin()->first.first;
      if (absl::Now() < next) {
        // Wakes early when an earlier deadline is scheduled, or to stop.
        auto earlier = [this, next]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
          return stopping ||
                 (!queue.empty() && queue.begin()->first.first < next);
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
    mu.Unlock();
  }

  void Forget(const DeadlineTimer* owner, TimerId id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = by_owner.find(owner);
    if (it == by_owner.end()) return;
    it->second.erase(id);
    if (it->second.empty()) by_owner.erase(it);
  }

  absl::Mutex mu;
  std::map<std::pair<absl::Time, TimerId>, Entry> queue ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<TimerId, absl::Time> when ABSL_GUARDED_BY(mu);
  // Each timer's pending callbacks, so its destructor can drop them.
  absl::flat_hash_map<const DeadlineTimer*, absl::flat_hash_set<TimerId>>
      by_owner ABSL_GUARDED_BY(mu);
  TimerId next_id ABSL_GUARDED_BY(mu) = 1;
  // The timer whose callback is running, if any.
  const DeadlineTimer* running ABSL_GUARDED_BY(mu) = nullptr;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::thread thread;
};

namespace {

// The thread lives while any DeadlineTimer does: a process that has none
// (say, before it forks its workers) has no timer thread either.
ABSL_CONST_INIT absl::Mutex users_mu(absl::kConstInit);
DeadlineTimer::Shared* shared ABSL_GUARDED_BY(users_mu) = nullptr;
int users ABSL_GUARDED_BY(users_mu) = 0;

}  // namespace

DeadlineTimer::DeadlineTimer() {
  absl::MutexLock lock(&users_mu);
  if (users++ == 0) shared = new Shared;
  shared_ = shared;
}

DeadlineTimer::~DeadlineTimer() {
  Shared& t = *shared_;
  {
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
  Shared* last = nullptr;
  {
    absl::MutexLock lock(&users_mu);
    if (--users == 0) {
      last = shared;
      shared = nullptr;
    }
  }
  delete last;  // Joins the thread.
}

DeadlineTimer::TimerId DeadlineTimer::Schedule(absl::Time when,
                                               std::function<void()> fn) {
  Shared& t = *shared_;
  absl::MutexLock lock(&t.mu);
  TimerId id = t.next_id++;
  t.queue.emplace(std::make_pair(when, id), Shared::Entry{this, std::move(fn)});
  t.when.emplace(id, when);
  t.by_owner[this].insert(id);
  return id;
}

bool DeadlineTimer::Cancel(TimerId id) {
  Shared& t = *shared_;
  absl::MutexLock lock(&t.mu);
  auto it = t.when.find(id);
  if (it == t.when.end()) return false;
  t.queue.erase(std::make_pair(it->second, id));
  t.when.erase(it);
  t.Forget(this, id);
  return true;
}

}  // namespace cohort::base

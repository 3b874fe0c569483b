#include "store/deadline_timer.h"

namespace cohort::store {

DeadlineTimer::DeadlineTimer() : thread_([this] { Loop(); }) {}

DeadlineTimer::~DeadlineTimer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

DeadlineTimer::TimerId DeadlineTimer::Schedule(absl::Time when,
                                               std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  TimerId id = next_id_++;
  queue_.emplace(std::make_pair(when, id), std::move(fn));
  when_.emplace(id, when);
  return id;
}

bool DeadlineTimer::Cancel(TimerId id) {
  absl::MutexLock lock(&mu_);
  auto it = when_.find(id);
  if (it == when_.end()) return false;
  queue_.erase(std::make_pair(it->second, id));
  when_.erase(it);
  return true;
}

void DeadlineTimer::Loop() {
  mu_.Lock();
  while (!stopping_) {
    absl::Time next = queue_.empty() ? absl::InfiniteFuture()
                                     : queue_.begin()->first.first;
    if (absl::Now() < next) {
      // Wakes early when an earlier deadline is scheduled or on shutdown.
      auto earlier_or_stop = [this, next]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stopping_ ||
               (!queue_.empty() && queue_.begin()->first.first < next);
      };
      mu_.AwaitWithDeadline(absl::Condition(&earlier_or_stop), next);
      continue;
    }
    auto node = queue_.extract(queue_.begin());
    when_.erase(node.key().second);
    mu_.Unlock();
    node.mapped()();
    mu_.Lock();
  }
  mu_.Unlock();
}

}  // namespace cohort::store

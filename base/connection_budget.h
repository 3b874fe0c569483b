// ConnectionBudget: one bound on the connections several listeners hold.
#ifndef COHORT_BASE_CONNECTION_BUDGET_H_
#define COHORT_BASE_CONNECTION_BUDGET_H_

#include <atomic>
#include <cstddef>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace cohort::base {

// The connections a process's listeners may hold open together (cohortd's
// gRPC and TCPStore listeners: --max_connections), so that together they
// stay within the process's file descriptors. Thread-safe.
class ConnectionBudget {
 public:
  explicit ConnectionBudget(size_t max) : max_(max) {}
  ConnectionBudget(const ConnectionBudget&) = delete;
  ConnectionBudget& operator=(const ConnectionBudget&) = delete;

  size_t max() const { return max_; }
  size_t in_use() const { return used_.load(std::memory_order_relaxed); }

  // Claims one connection. When all max() are in use it first has the
  // reclaimer count the connections closed since it last looked (at most
  // once per kReclaimEvery, since that checks every descriptor); false if
  // none is free then.
  bool TryTake();
  // Gives back `n` connections taken.
  void Give(size_t n = 1) { used_.fetch_sub(n, std::memory_order_relaxed); }

  // `reclaim` gives back the connections whose peers closed them behind the
  // listener's back (gRPC closes the sockets the Listener hands it). Null
  // clears it; it is never running once this returns.
  void SetReclaimer(std::function<void()> reclaim);

  static constexpr absl::Duration kReclaimEvery = absl::Milliseconds(20);

 private:
  bool TakeIfFree();

  const size_t max_;
  std::atomic<size_t> used_{0};
  absl::Mutex reclaim_mu_;
  std::function<void()> reclaim_ ABSL_GUARDED_BY(reclaim_mu_);
  absl::Time last_reclaim_ ABSL_GUARDED_BY(reclaim_mu_) = absl::InfinitePast();
};

}  // namespace cohort::base

#endif  // COHORT_BASE_CONNECTION_BUDGET_H_

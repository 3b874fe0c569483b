#include "base/connection_budget.h"

#include <utility>

#include "absl/time/clock.h"

namespace cohort::base {

bool ConnectionBudget::TakeIfFree() {
  size_t used = used_.load(std::memory_order_relaxed);
  while (used < max_) {
    if (used_.compare_exchange_weak(used, used + 1,
                                    std::memory_order_relaxed)) {
      return true;
    }
  }
  return false;
}

bool ConnectionBudget::TryTake() {
  if (TakeIfFree()) return true;
  {
    absl::MutexLock lock(&reclaim_mu_);
    const absl::Time now = absl::Now();
    if (reclaim_ == nullptr || now - last_reclaim_ < kReclaimEvery) {
      return false;
    }
    last_reclaim_ = now;
    reclaim_();
  }
  return TakeIfFree();
}

void ConnectionBudget::SetReclaimer(std::function<void()> reclaim) {
  absl::MutexLock lock(&reclaim_mu_);
  reclaim_ = std::move(reclaim);
}

}  // namespace cohort::base

#include "server/coordination_slot.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace cohort::server {

absl::StatusOr<Coordination> CoordinationSlot::Get() const {
  absl::MutexLock lock(&mu_);
  if (current_.rendezvous != nullptr) return current_;
  return absl::UnavailableError(absl::StrCat(
      kNotLeader, leader_.empty()
                      ? std::string("no leader is elected yet; retry shortly")
                      : absl::StrCat("the leader is at ", leader_)));
}

void CoordinationSlot::Fill(Coordination coordination) {
  absl::MutexLock lock(&mu_);
  current_ = std::move(coordination);
  leader_.clear();
}

Coordination CoordinationSlot::Empty(std::string leader) {
  absl::MutexLock lock(&mu_);
  leader_ = std::move(leader);
  return std::exchange(current_, Coordination());
}

void CoordinationSlot::SetLeader(std::string leader) {
  absl::MutexLock lock(&mu_);
  leader_ = std::move(leader);
}

std::string CoordinationSlot::leader() const {
  absl::MutexLock lock(&mu_);
  return leader_;
}

}  // namespace cohort::server

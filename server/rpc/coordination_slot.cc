#include "server/rpc/coordination_slot.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"

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
  SetLeaderLocked("");
}

Coordination CoordinationSlot::Empty(std::string leader) {
  absl::MutexLock lock(&mu_);
  SetLeaderLocked(std::move(leader));
  return std::exchange(current_, Coordination());
}

void CoordinationSlot::SetLeader(std::string leader) {
  absl::MutexLock lock(&mu_);
  SetLeaderLocked(std::move(leader));
}

void CoordinationSlot::SetLeaderLocked(std::string leader) {
  if (leader == leader_ && (stubs_ != nullptr) == !leader.empty()) return;
  leader_ = std::move(leader);
  if (leader_.empty()) {
    stubs_ = nullptr;
    return;
  }
  auto stubs = std::make_shared<LeaderStubs>();
  stubs->address = leader_;
  stubs->channel =
      grpc::CreateChannel(leader_, grpc::InsecureChannelCredentials());
  stubs->rendezvous = v1::Rendezvous::NewStub(stubs->channel);
  stubs->membership = v1::Membership::NewStub(stubs->channel);
  stubs_ = std::move(stubs);
}

std::shared_ptr<const LeaderStubs> CoordinationSlot::leader_stubs() const {
  absl::MutexLock lock(&mu_);
  return stubs_;
}

std::string CoordinationSlot::leader() const {
  absl::MutexLock lock(&mu_);
  return leader_;
}

}  // namespace cohort::server

// EtcdLeadership: elects one leader among the cohortd replicas that share
// an etcd cluster, for the state machines only one may run (rendezvous,
// membership, barriers).
//
// A replica campaigns by creating the election key, with its address as
// the value, under a lease of `ttl`, in a transaction that succeeds only if
// the key is absent. The winner keeps the lease alive every ttl/3; the
// others read the key every poll interval and campaign again once it is
// gone, i.e. at most `ttl` after the leader stopped renewing it.
//
// The leader steps down on its own when it has not renewed the lease for
// ttl minus a margin, so it stops acting before etcd lets anyone else win.
// The failover bound is therefore ttl + poll + the time to rebuild the
// state machines from the store (measured: bench/etcd_bench.md).
#ifndef COHORT_SERVER_HA_ETCD_LEADERSHIP_H_
#define COHORT_SERVER_HA_ETCD_LEADERSHIP_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace cohort::server {

struct EtcdLeadershipOptions {
  std::vector<std::string> endpoints;
  // The election key (outside the store's key prefix).
  std::string key = "/cohort/leader";
  // This replica's address as clients and other replicas reach it.
  std::string address;
  absl::Duration ttl = absl::Seconds(3);
  absl::Duration poll = absl::Milliseconds(250);
  absl::Duration call_timeout = absl::Seconds(2);
  // Called on the election thread, in order: this replica now leads
  // (`elected`), or another one does ("" while none is known).
  std::function<void()> elected;
  std::function<void(const std::string& leader)> follows;
  std::function<void(absl::string_view)> log;
};

class EtcdLeadership {
 public:
  // Starts campaigning on a thread of its own.
  explicit EtcdLeadership(EtcdLeadershipOptions options);
  // Stops; a leader resigns (deletes the key by revoking its lease), so
  // another replica takes over at once rather than after the lease's ttl.
  ~EtcdLeadership();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_HA_ETCD_LEADERSHIP_H_

// EtcdEngine: a shared KvEngine (store/kv_engine.h) whose keys live in an
// etcd cluster, under a prefix, so that several cohortd replicas serve one
// store and none keeps state another needs.
//
// - Revisions are etcd's. Every commit is one etcd transaction: plain puts
//   and deletes, compared on each guarded key's modification revision
//   (Add, CompareSet, Append read before they write).
// - The engine's view (every key and value under the prefix, with its
//   modification revision) is loaded from etcd at start and then follows a
//   single etcd watch from the next revision, which brings every writer's
//   changes, this replica's own included, in revision order. KvStore wakes
//   waiters and watchers from that feed, so a write through any replica,
//   or straight into etcd, wakes them on every replica.
// - Reads are linearizable: ReadBarrier reads the revision of the last
//   commit (every commit also writes a reserved key; a quorum read of it),
//   then waits until the watch has brought the view to that revision.
// - Endpoints are tried in turn: a call, or the watch, that loses its etcd
//   member goes on with the next; the watch resumes from the revision after
//   the last one it delivered.
#ifndef COHORT_SERVER_HA_ETCD_ENGINE_H_
#define COHORT_SERVER_HA_ETCD_ENGINE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "store/kv_engine.h"

namespace cohort::server {

struct EtcdEngineOptions {
  // HOST:PORT of etcd's client port (2379), one per member.
  std::vector<std::string> endpoints;
  // Every key is stored under this prefix in etcd; not empty.
  std::string prefix = "/cohort/kv/";
  // Deadline of each etcd call.
  absl::Duration call_timeout = absl::Seconds(5);
  // At start the watch replays up to this many revisions from before the
  // load (those etcd still holds), so that a watch can resume from them on
  // this replica too (after a failover, say).
  int64_t history_revisions = 10000;
  // How long the engine keeps trying members at start before giving up.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Where failovers and watch restarts are reported.
  std::function<void(absl::string_view)> log;
};

// Connects, loads the view and returns the engine; UNAVAILABLE naming the
// endpoints when none answers within connect_timeout, INVALID_ARGUMENT for
// bad options.
absl::StatusOr<std::unique_ptr<store::KvEngine>> OpenEtcdEngine(
    EtcdEngineOptions options);

// The etcd range end covering every key that starts with `prefix`.
std::string EtcdPrefixEnd(absl::string_view prefix);

}  // namespace cohort::server

#endif  // COHORT_SERVER_HA_ETCD_ENGINE_H_

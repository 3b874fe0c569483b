// Where a node's workers' torch stores go (cohortd's TCPStore listener,
// behind the node's proxy), and cohortrun's start-up check that it is
// there and belongs to the cohortd the node joins through.
//
// Without --tcpstore (or $COHORT_TCPSTORE), cohortrun asks cohortd
// (cohort.v1.Info): the listener's --tcpstore_advertise, else its bound
// address, a wildcard host replaced by the host cohortrun dialed. Then,
// wherever the address came from, CheckTorchStore connects as the proxy
// will and asks for a key written through cohortd (client/tcpstore_check.h)
// before any worker starts, so a wrong address fails in seconds, saying
// which address, where it came from and why, instead of as torch's
// "Connection reset by peer" in every worker.
#ifndef COHORT_WORKER_LAUNCH_TORCH_STORE_H_
#define COHORT_WORKER_LAUNCH_TORCH_STORE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/info_client.h"
#include "client/store.h"

namespace cohort {

struct TorchStoreLocation {
  // HOST:PORT of cohortd's TCPStore listener; empty when it serves none
  // (then the workers get no torch store, and `source` says why).
  std::string address;
  // Where the address came from, for messages: "--tcpstore",
  // "$COHORT_TCPSTORE", or what cohortd said and how it chose it.
  std::string source;
  // The listener's --tcpstore_prefix, as cohortd reported it.
  std::string listener_prefix;
  // Whether `source` is the user's (--tcpstore, $COHORT_TCPSTORE).
  bool overridden = false;
};

// Decides where the torch stores go: `flag` (--tcpstore) when not empty,
// else `env` ($COHORT_TCPSTORE), else `info`, the answer of the cohortd at
// `coordinator` to GetServerInfo. An UNIMPLEMENTED answer (a cohortd
// older than cohort.v1.Info) falls back to DefaultTcpStore(coordinator);
// any other error is returned, naming the coordinator. With `flag` or
// `env`, `info` only supplies the listener's prefix. Peer-chosen text in
// `source` is escaped.
absl::StatusOr<TorchStoreLocation> LocateTorchStore(
    const std::string& flag, const std::string& env,
    const std::string& coordinator, const absl::StatusOr<v1::ServerInfo>& info);

struct TorchStoreCheckOptions {
  // The run: the check's hello binds "/cohortrun/<run id>/", the
  // namespace above its rounds', which the workers' token covers.
  std::string run_id;
  // The token the node's proxy sends in its hellos (the workers' own);
  // empty: none.
  std::string token;
  // Bounds each TCP connect attempt, and then the answers together.
  absl::Duration timeout = absl::Seconds(5);
};

// Checks that `where.address` serves the keys of the cohortd `grpc_store`
// reaches (CheckTcpStoreListener). On success returns the line to log
// ("... checked: it serves cohortd's keys", or what could not be checked).
// On failure the status's message names the address, its source, why,
// and what to change. REQUIRES: where.address is not empty.
absl::StatusOr<std::string> CheckTorchStore(
    Store& grpc_store, const TorchStoreLocation& where,
    const TorchStoreCheckOptions& options);

}  // namespace cohort

#endif  // COHORT_WORKER_LAUNCH_TORCH_STORE_H_

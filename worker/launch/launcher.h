// Launcher: what cohortrun does on one node, the torchrun of cohort.
//
// Each round it joins the run's rendezvous as one node, joins the membership
// group named after the run (so peers see it fail), starts one worker
// process per local rank with the environment torchrun gives a
// torch.distributed program, and watches three things: its workers, its peers'
// membership events, and nodes waiting to join the run. When a worker fails or
// a peer goes away it stops its workers and joins the next round, up to
// max_restarts times; when nodes wait to join (and the round is below
// max_nodes) it does the same without counting a restart, as torchrun does.
//
// The workers' torch store (MASTER_ADDR:MASTER_PORT, with
// TORCHELASTIC_USE_AGENT_STORE=True) is a TcpStoreProxy on this node's
// loopback that connects them to cohortd's TCPStore listener, every key
// under /cohortrun/<run id>/<round>/: no worker hosts a store, jobs sharing
// cohortd are isolated, and each round starts with no keys.
//
//   Launcher launcher(options, std::move(rendezvous), std::move(membership));
//   return launcher.Run();
#ifndef COHORT_WORKER_LAUNCH_LAUNCHER_H_
#define COHORT_WORKER_LAUNCH_LAUNCHER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/membership_client.h"
#include "client/rendezvous_client.h"
#include "client/store.h"
#include "worker/launch/local_workers.h"
#include "worker/launch/tcpstore_proxy.h"

namespace cohort {

// The port of cohortd's TCPStore listener unless told otherwise (cohortd's
// --tcpstore_listen default, and torchrun's c10d rendezvous port).
inline constexpr int kDefaultTcpStorePort = 29400;

struct LauncherOptions {
  // HOST:PORT of cohortd; handed to workers as COHORT_ADDR.
  std::string coordinator = kDefaultAddress;
  // HOST:PORT of cohortd's TCPStore listener, where the node's proxy sends
  // the workers' torch store connections. Empty: DefaultTcpStore(coordinator).
  std::string tcpstore;
  // cohortd serves no TCPStore listener: no proxy runs, and the workers get
  // no MASTER_ADDR, MASTER_PORT or TORCHELASTIC_USE_AGENT_STORE (torch's
  // env:// then says so at once; cohort's own env:// uses COHORT_ADDR).
  bool no_torch_store = false;
  std::string run_id;
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc_per_node = 1;
  // Restarts after a failure (of a local worker or a peer node).
  int max_restarts = 0;
  // Prefix each line of worker output with "[rank N] ".
  bool tee = false;
  // Unique in the run; node ranks follow the order of node ids. Empty:
  // "<hostname>-<pid>".
  std::string node_id;
  // How peers reach this node. Empty: gethostname().
  std::string hostname;
  // PROGRAM ARGS...
  std::vector<std::string> command;
  // Set in every worker's environment, over what cohortrun's own holds
  // (cohortrun puts the workers' own token and TLS files here).
  std::vector<std::pair<std::string, std::string>> worker_env;
  // The token the node's TCPStore proxy sends cohortd for its workers'
  // torch stores (the workers' own token); empty: none.
  std::string store_token;

  absl::Duration heartbeat_interval = absl::Seconds(5);
  // Between SIGTERM and SIGKILL when stopping workers.
  absl::Duration stop_grace = absl::Seconds(5);
  // Of each rendezvous round (see RendezvousOptions).
  absl::Duration join_timeout = absl::Seconds(600);
  absl::Duration last_call_timeout = absl::Seconds(30);
  // How long the nodes of a round may take to join the group once the
  // rendezvous completed (a node that fails in between is noticed then).
  absl::Duration group_join_timeout = absl::Seconds(60);
  // How long a node whose workers all succeeded stays in the group waiting
  // for its peers to finish (torchrun's exit barrier): leaving earlier would
  // look like a failure to peers still running.
  absl::Duration exit_barrier_timeout = absl::Seconds(300);
  // How often workers are polled, and how often the run is asked whether
  // nodes wait to join.
  absl::Duration poll_interval = absl::Milliseconds(50);
  absl::Duration run_status_interval = absl::Seconds(1);

  // cohortd's store. Before stopping the workers of a round that failed (a
  // worker failed, or a peer node did), the launcher asks every rank of
  // the run for its flight records (client/flight_catalog.h) and waits up
  // to flight_dump_wait for the answers of its ranks that have a dumper
  // (they published a start dump this round) and still run, or the dumps
  // they made as an op failed, so that a diagnosis sees where they were.
  // Null: no dumps.
  std::shared_ptr<Store> store;
  absl::Duration flight_dump_wait = absl::Seconds(3);

  // Where "cohortrun: ..." lines go (one call per line, no newline).
  // Default: stderr. Worker output goes to these fds (tests redirect it).
  std::function<void(const std::string&)> log;
  int stdout_fd = STDOUT_FILENO;
  int stderr_fd = STDERR_FILENO;
};

// The coordinator's host with kDefaultTcpStorePort: "cohortd:29500" ->
// "cohortd:29400", "[::1]:29500" -> "[::1]:29400".
std::string DefaultTcpStore(const std::string& coordinator);

// The namespace of a round's torch keys on cohortd's TCPStore listener:
// "/cohortrun/<run_id>/<round>/". Run ids have no "/" (cohortd refuses
// them), so no two runs or rounds share one.
std::string StoreNamespace(const std::string& run_id, int64_t round);

// "2" -> {2, 2}; "1:4" -> {1, 4}. INVALID_ARGUMENT unless 1 <= min <= max.
absl::StatusOr<std::pair<int, int>> ParseNodeRange(const std::string& range);

class Launcher {
 public:
  // REQUIRES: options.run_id and options.command are not empty.
  Launcher(LauncherOptions options,
           std::unique_ptr<RendezvousClient> rendezvous,
           std::unique_ptr<MembershipClient> membership);
  ~Launcher();

  // Runs the job on this node until its workers succeed, a failure is
  // beyond max_restarts, or Stop. Returns cohortrun's exit status: 0 when
  // every local worker of the last round exited 0; after Stop, the workers'
  // status (128 + signal when the signal killed them); otherwise 1, having
  // logged which rank failed, how, and on which attempt.
  int Run();

  // Thread-safe; for a signal-handling thread. Forwards `signal` to the
  // workers (then SIGKILL after stop_grace) and makes Run return. Returns
  // false when Run has no workers and is blocked in a call to cohortd that
  // cannot be interrupted (connecting, the rendezvous, a barrier): the
  // caller should then exit the process itself.
  bool Stop(int signal);

 private:
  // One rendezvous round and this node's membership in it.
  struct Round {
    RendezvousResult rendezvous;
    std::unique_ptr<GroupMember> member;
    // The incarnation each peer of the round has in the group. Events of
    // other incarnations (a peer's earlier rounds) are history.
    absl::flat_hash_map<std::string, int64_t> peer_incarnations;
  };

  // Why a round ended.
  struct RoundEnd {
    enum class Kind {
      kSucceeded,     // Every local worker exited 0.
      kWorkerFailed,  // A local worker failed: costs a restart.
      kPeerFailed,    // A peer failed, left or reported an error: likewise.
      kScaleUp,       // Nodes wait to join: restart, free of charge.
      kStopped,       // Stop(signal).
      kFatal,         // Cannot go on (cohortd unreachable, no program).
    };
    Kind kind = Kind::kFatal;
    std::string reason;
    int exit_status = 1;  // For kStopped.
  };

  // Joins the rendezvous and the group, waits until every node of the round
  // is in the group, and meets them at the round's start barrier. ABORTED
  // when a peer did not join in time or failed meanwhile (worth a restart);
  // CANCELLED after Stop; anything else is fatal.
  absl::StatusOr<Round> StartRound();
  // The group incarnation of each peer of the round, once all have joined
  // (ABORTED if some have not by `deadline`).
  absl::StatusOr<absl::flat_hash_map<std::string, int64_t>> WaitForPeers(
      const Round& round, absl::Time deadline);

  // Runs the round's workers until one of the triggers above.
  RoundEnd RunRound(Round& round, int restart_count);
  // Points the node's TcpStoreProxy (started on the first call) at the
  // round's namespace; returns its port.
  absl::StatusOr<int> BindTorchStore(const RendezvousResult& r);
  std::vector<WorkerSpec> WorkerSpecs(const Round& round, int restart_count,
                                      int store_port) const;
  // The first relevant failure among the peer events received so far.
  std::optional<std::string> PeerTrouble(const Round& round);
  // Requests flight dumps; waits for those of this node's ranks that still
  // run (the ranks in `exited` and those `workers` sees exit are not
  // waited for).
  void DumpFlightRecords(const Round& round, LocalWorkers& workers,
                         const std::set<int>& exited);
  // Whether nodes wait to join a round that has room for them.
  std::optional<std::string> NodesWaiting(const Round& round);

  // Waits for the peers to finish, leaves the group, returns 0.
  int Finish(Round& round);
  void Leave(Round& round);

  void OnMemberEvent(const MemberEvent& event);
  bool HasNews() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks Run as blocked in an uninterruptible call; false (and no mark) if
  // a stop signal came first.
  bool BeginBlocking(const std::string& what);
  void EndBlocking();
  int stop_signal() const;
  void Log(const std::string& line) const;

  const LauncherOptions options_;
  const std::unique_ptr<RendezvousClient> rendezvous_;
  const std::unique_ptr<MembershipClient> membership_;
  std::unique_ptr<MemberWatch> watch_;
  std::unique_ptr<TcpStoreProxy> proxy_;  // Run's thread only.

  mutable absl::Mutex mu_;
  // Member events not yet looked at, from the watch's thread.
  std::deque<MemberEvent> events_ ABSL_GUARDED_BY(mu_);
  int stop_signal_ ABSL_GUARDED_BY(mu_) = 0;
  // What Run is blocked in, or empty.
  std::string blocked_in_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cohort

#endif  // COHORT_WORKER_LAUNCH_LAUNCHER_H_

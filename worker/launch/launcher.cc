#include "worker/launch/launcher.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/net.h"
#include "base/text.h"
#include "client/flight_catalog.h"

extern char** environ;

namespace cohort {
namespace {

LauncherOptions WithDefaults(LauncherOptions options) {
  if (options.hostname.empty()) {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    options.hostname = name[0] != '\0' ? name : "localhost";
  }
  if (options.node_id.empty()) {
    options.node_id = absl::StrCat(options.hostname, "-", getpid());
  }
  if (options.tcpstore.empty() && !options.no_torch_store) {
    options.tcpstore = DefaultTcpStore(options.coordinator);
  }
  if (!options.log) {
    options.log = [](const std::string& line) {
      std::fprintf(stderr, "cohortrun: %s\n", line.c_str());
    };
  }
  return options;
}

std::string RankRange(int first, int count) {
  if (count == 1) return absl::StrCat("rank ", first);
  return absl::StrCat("ranks ", first, "-", first + count - 1);
}

// What a failed worker tells its peers, through the group.
std::string FailureReport(const WorkerExit& exit) {
  if (WIFEXITED(exit.wait_status)) {
    return absl::StrCat("rank ", exit.rank, " exited with code ",
                        WEXITSTATUS(exit.wait_status));
  }
  return absl::StrCat("rank ", exit.rank, " was killed by ", exit.Describe());
}

// How often the group is listed while waiting for a round's nodes to join.
constexpr absl::Duration kGroupPollInterval = absl::Milliseconds(100);

std::string Plural(int n, const std::string& noun) {
  return absl::StrCat(n, " ", noun, n == 1 ? "" : "s");
}

bool InEnvironment(const char* name) { return std::getenv(name) != nullptr; }

}  // namespace

std::string DefaultTcpStore(const std::string& coordinator) {
  absl::StatusOr<base::HostPort> split = base::SplitHostPort(coordinator);
  return base::JoinHostPort(split.ok() ? split->host : "localhost",
                            kDefaultTcpStorePort);
}

std::string StoreNamespace(const std::string& run_id, int64_t round) {
  return absl::StrCat("/cohortrun/", run_id, "/", round, "/");
}

absl::StatusOr<std::pair<int, int>> ParseNodeRange(const std::string& range) {
  std::vector<std::string> parts = absl::StrSplit(range, ':');
  int min = 0;
  int max = 0;
  bool parsed = (parts.size() == 1 || parts.size() == 2) &&
                absl::SimpleAtoi(parts.front(), &min) &&
                absl::SimpleAtoi(parts.back(), &max);
  if (!parsed || min < 1 || max < min) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", range, "\" is not N or MIN:MAX with 1 <= MIN <= MAX"));
  }
  return std::make_pair(min, max);
}

Launcher::Launcher(LauncherOptions options,
                   std::unique_ptr<RendezvousClient> rendezvous,
                   std::unique_ptr<MembershipClient> membership)
    : options_(WithDefaults(std::move(options))),
      rendezvous_(std::move(rendezvous)),
      membership_(std::move(membership)) {}

Launcher::~Launcher() {
  // Before the members its callback touches go away.
  if (watch_ != nullptr) watch_->Cancel();
  watch_.reset();
}

int Launcher::Run() {
  // Watching from before the first join means no event of any round can be
  // missed; which ones matter is decided per round (PeerTrouble).
  const std::string connecting =
      absl::StrCat("connecting to cohortd at ", options_.coordinator);
  if (!BeginBlocking(connecting)) return 128 + stop_signal();
  Log(absl::StrCat(connecting, "..."));
  absl::StatusOr<std::unique_ptr<MemberWatch>> watch = membership_->Watch(
      options_.run_id,
      [this](const MemberEvent& event) { OnMemberEvent(event); });
  EndBlocking();
  if (!watch.ok()) {
    Log(absl::StrCat("cannot watch group ", options_.run_id, ": ",
                     watch.status().ToString()));
    return 1;
  }
  watch_ = std::move(*watch);
  if (!InEnvironment("OMP_NUM_THREADS") && options_.nproc_per_node > 1) {
    Log(absl::StrCat("setting OMP_NUM_THREADS=1 for each of the ",
                     options_.nproc_per_node,
                     " workers (as torchrun does); set it to choose"));
  }

  for (int restart_count = 0;;) {
    RoundEnd end;
    absl::StatusOr<Round> round = StartRound();
    if (round.ok()) {
      end = RunRound(*round, restart_count);
      if (end.kind == RoundEnd::Kind::kSucceeded) return Finish(*round);
      // Peers see this node leave: they restart too, or stop waiting for it
      // at their exit barrier.
      Leave(*round);
    } else if (int signal = stop_signal(); signal != 0) {
      end = {RoundEnd::Kind::kStopped, SignalName(signal), 128 + signal};
    } else if (absl::IsAborted(round.status())) {
      end = {RoundEnd::Kind::kPeerFailed,
             std::string(round.status().message())};
    } else {
      end = {RoundEnd::Kind::kFatal, round.status().ToString()};
    }

    const std::string attempt = absl::StrCat(
        "attempt ", restart_count + 1, " of ", options_.max_restarts + 1,
        " (max restarts ", options_.max_restarts, ")");
    switch (end.kind) {
      case RoundEnd::Kind::kSucceeded:
        break;  // Returned above.
      case RoundEnd::Kind::kStopped:
        Log(absl::StrCat("stopped by ", end.reason, "; exit status ",
                         end.exit_status));
        return end.exit_status;
      case RoundEnd::Kind::kFatal:
        Log(absl::StrCat(end.reason, "; giving up"));
        return 1;
      case RoundEnd::Kind::kScaleUp:
        Log(absl::StrCat("restarting: ", end.reason,
                         " (not counted as a restart)"));
        break;
      case RoundEnd::Kind::kWorkerFailed:
      case RoundEnd::Kind::kPeerFailed:
        if (restart_count >= options_.max_restarts) {
          Log(absl::StrCat(end.reason, " on ", attempt, "; giving up"));
          return 1;
        }
        ++restart_count;
        Log(absl::StrCat("restarting: ", end.reason, " (restart ",
                         restart_count, " of ", options_.max_restarts, ")"));
        break;
    }
  }
}

bool Launcher::Stop(int signal) {
  absl::MutexLock lock(&mu_);
  if (stop_signal_ == 0) stop_signal_ = signal;
  if (blocked_in_.empty()) return true;
  Log(absl::StrCat(SignalName(signal), " while ", blocked_in_,
                   ", which cannot be interrupted; exiting"));
  return false;
}

absl::StatusOr<Launcher::Round> Launcher::StartRound() {
  RendezvousOptions join;
  join.run_id = options_.run_id;
  join.node_id = options_.node_id;
  join.address = options_.hostname;
  join.local_world_size = options_.nproc_per_node;
  join.min_nodes = options_.min_nodes;
  join.max_nodes = options_.max_nodes;
  join.join_timeout = options_.join_timeout;
  join.last_call_timeout = options_.last_call_timeout;
  const std::string joining = absl::StrCat(
      "joining run ", options_.run_id, " (nodes ", options_.min_nodes, ":",
      options_.max_nodes, ") as ", options_.node_id);
  if (!BeginBlocking(joining)) return absl::CancelledError("stopped");
  Log(absl::StrCat(joining, "..."));
  absl::StatusOr<RendezvousResult> joined = rendezvous_->Join(join);
  EndBlocking();
  if (!joined.ok()) {
    return absl::Status(joined.status().code(),
                        absl::StrCat("joining run ", options_.run_id, ": ",
                                     joined.status().message()));
  }

  Round round;
  round.rendezvous = *std::move(joined);
  const RendezvousResult& r = round.rendezvous;
  Log(absl::StrCat("round ", r.round, ": node rank ", r.node_rank, " of ",
                   r.num_nodes, ", world size ", r.world_size, ", ",
                   RankRange(r.first_global_rank, options_.nproc_per_node)));

  MemberOptions member;
  member.group = options_.run_id;
  member.name = options_.node_id;
  member.rank = r.node_rank;
  member.host = options_.hostname;
  member.heartbeat_interval = options_.heartbeat_interval;
  absl::StatusOr<std::unique_ptr<GroupMember>> joined_group =
      membership_->JoinGroup(member);
  if (!joined_group.ok()) {
    return absl::UnavailableError(
        absl::StrCat("joining group ", options_.run_id, ": ",
                     joined_group.status().ToString()));
  }
  round.member = *std::move(joined_group);

  // Workers start only once every node of the round is in the group, so
  // that from then on a node that fails is seen failing.
  const absl::Time deadline = absl::Now() + options_.group_join_timeout;
  absl::StatusOr<absl::flat_hash_map<std::string, int64_t>> incarnations =
      WaitForPeers(round, deadline);
  if (!incarnations.ok()) return incarnations.status();
  round.peer_incarnations = *std::move(incarnations);
  if (r.num_nodes == 1) return round;

  // And only once every node has seen all the others: else a node whose
  // workers fail at once could leave before a slower peer listed it, and
  // that peer would wait for it until the timeout. A node that fails or is
  // replaced before arriving aborts the barrier, so the incarnations listed
  // above are still the ones to watch once it completes.
  std::vector<std::string> nodes;
  for (const RendezvousPeer& peer : r.peers) nodes.push_back(peer.node_id);
  if (!BeginBlocking(absl::StrCat("waiting for the nodes of round ", r.round,
                                  " to start"))) {
    return absl::CancelledError("stopped");
  }
  absl::Status all_in = round.member->Barrier(
      absl::StrCat("cohortrun.round-", r.round, ".start"),
      std::max(deadline - absl::Now(), absl::Milliseconds(1)), nodes);
  EndBlocking();
  if (absl::IsAborted(all_in) || absl::IsDeadlineExceeded(all_in)) {
    return absl::AbortedError(absl::StrCat(
        "round ", r.round, " could not start: ", all_in.message()));
  }
  if (!all_in.ok()) return all_in;
  return round;
}

absl::StatusOr<absl::flat_hash_map<std::string, int64_t>>
Launcher::WaitForPeers(const Round& round, absl::Time deadline) {
  const RendezvousResult& r = round.rendezvous;
  if (r.num_nodes > 1) {
    Log(absl::StrCat("round ", r.round, ": waiting for the other ",
                     Plural(r.num_nodes - 1, "node"), " to join group ",
                     options_.run_id));
  }
  for (;;) {
    absl::StatusOr<std::vector<Member>> members =
        membership_->ListMembers(options_.run_id);
    if (!members.ok()) return members.status();
    absl::flat_hash_map<std::string, const Member*> live;
    for (const Member& member : *members) live[member.name] = &member;
    absl::flat_hash_map<std::string, int64_t> peers;
    std::vector<std::string> missing;
    for (const RendezvousPeer& peer : r.peers) {
      if (peer.node_id == options_.node_id) continue;
      auto it = live.find(peer.node_id);
      // A peer's membership from an earlier round carries that round's
      // node rank (when it differs): not the one to watch.
      if (it == live.end() || it->second->rank != peer.node_rank) {
        missing.push_back(base::Escape(peer.node_id));
      } else {
        peers[peer.node_id] = it->second->incarnation;
      }
    }
    if (missing.empty()) return peers;
    if (stop_signal() != 0) return absl::CancelledError("stopped");
    if (absl::Now() >= deadline) {
      // It failed between the rendezvous and joining the group.
      return absl::AbortedError(
          absl::StrCat("round ", r.round, " could not start: after ",
                       absl::FormatDuration(options_.group_join_timeout), ", ",
                       Plural(missing.size(), "node"), " had not joined group ",
                       options_.run_id, ": ", absl::StrJoin(missing, ", ")));
    }
    absl::SleepFor(kGroupPollInterval);
  }
}

Launcher::RoundEnd Launcher::RunRound(Round& round, int restart_count) {
  const RendezvousResult& r = round.rendezvous;
  if (int signal = stop_signal(); signal != 0) {
    return {RoundEnd::Kind::kStopped, SignalName(signal), 128 + signal};
  }
  absl::StatusOr<int> store_port =
      options_.no_torch_store ? absl::StatusOr<int>(0) : BindTorchStore(r);
  if (!store_port.ok()) {
    std::string why = absl::StrCat(
        options_.node_id,
        " cannot start its torch store proxy: ", store_port.status().message());
    round.member->ReportError(why).IgnoreError();
    return {RoundEnd::Kind::kFatal, why};
  }
  LocalWorkersOptions spawn;
  spawn.command = options_.command;
  spawn.tee = options_.tee;
  spawn.stdout_fd = options_.stdout_fd;
  spawn.stderr_fd = options_.stderr_fd;
  absl::StatusOr<std::unique_ptr<LocalWorkers>> started = LocalWorkers::Start(
      spawn, WorkerSpecs(round, restart_count, *store_port));
  if (!started.ok()) {
    std::string why =
        absl::StrCat(options_.node_id,
                     " cannot start workers: ", started.status().message());
    round.member->ReportError(why).IgnoreError();
    return {RoundEnd::Kind::kFatal, why};
  }
  LocalWorkers& workers = **started;
  Log(absl::StrCat("round ", r.round, ": running ",
                   RankRange(r.first_global_rank, options_.nproc_per_node),
                   " (pids ", absl::StrJoin(workers.pids(), ", "), ")"));

  absl::Time next_run_status = absl::Now() + options_.run_status_interval;
  for (;;) {
    const std::vector<WorkerExit> exits = workers.Poll();
    for (const WorkerExit& exit : exits) {
      if (exit.ok()) continue;
      // Told before stopping the other workers, so peers stop theirs sooner.
      round.member->ReportError(FailureReport(exit)).IgnoreError();
      // Every worker this poll reaped is gone (a rank killed at the same
      // moment as the one reported, say): none of them will answer.
      std::set<int> gone;
      for (const WorkerExit& e : exits) gone.insert(e.rank);
      DumpFlightRecords(round, workers, gone);
      workers.Stop(SIGTERM, options_.stop_grace);
      return {RoundEnd::Kind::kWorkerFailed,
              absl::StrCat("rank ", exit.rank, " (local rank ", exit.local_rank,
                           ") failed with ", exit.Describe())};
    }
    if (workers.AllExited()) return {RoundEnd::Kind::kSucceeded};

    if (int signal = stop_signal(); signal != 0) {
      Log(absl::StrCat("forwarding ", SignalName(signal), " to ",
                       Plural(options_.nproc_per_node, "worker")));
      // Status of the first worker (in rank order) that did not exit 0.
      int status = 0;
      for (const WorkerExit& exit : workers.Stop(signal, options_.stop_grace)) {
        if (status == 0) status = exit.ShellStatus();
      }
      return {RoundEnd::Kind::kStopped, SignalName(signal), status};
    }
    if (std::optional<std::string> trouble = PeerTrouble(round)) {
      DumpFlightRecords(round, workers, {});
      workers.Stop(SIGTERM, options_.stop_grace);
      return {RoundEnd::Kind::kPeerFailed, *trouble};
    }
    if (absl::Now() >= next_run_status) {
      next_run_status = absl::Now() + options_.run_status_interval;
      if (std::optional<std::string> waiting = NodesWaiting(round)) {
        workers.Stop(SIGTERM, options_.stop_grace);
        return {RoundEnd::Kind::kScaleUp, *waiting};
      }
    }
    // Wakes at once for a stop signal or a member event.
    mu_.LockWhenWithTimeout(absl::Condition(this, &Launcher::HasNews),
                            options_.poll_interval);
    mu_.Unlock();
  }
}

void Launcher::DumpFlightRecords(const Round& round, LocalWorkers& workers,
                                 const std::set<int>& exited) {
  if (options_.store == nullptr) return;
  const RendezvousResult& r = round.rendezvous;
  FlightCatalog catalog(options_.store.get(), options_.run_id);
  absl::StatusOr<int64_t> request = catalog.Request();
  if (!request.ok()) {
    Log(absl::StrCat("round ", r.round, ": cannot request flight dumps: ",
                     request.status().ToString()));
    return;
  }
  // Only workers with a dumper answer: those that published a start dump
  // in this round (a torch program on torch's own backends never does).
  std::set<int> waiting;
  absl::StatusOr<FlightCatalog::AnswerList> started =
      catalog.ListAnswers(r.round);
  if (started.ok()) {
    for (const flight::FlightAnswer& a : started->answers) {
      const int local = a.rank - r.first_global_rank;
      if (local >= 0 && local < options_.nproc_per_node &&
          exited.count(a.rank) == 0) {
        waiting.insert(a.rank);
      }
    }
  }
  if (waiting.empty()) return;  // Nothing here dumps.
  const absl::Time deadline = absl::Now() + options_.flight_dump_wait;
  while (!waiting.empty() && absl::Now() < deadline) {
    // A worker that has exited will not answer (its exit is reported by
    // the round's end, which follows).
    for (const WorkerExit& e : workers.Poll()) waiting.erase(e.rank);
    absl::StatusOr<FlightCatalog::AnswerList> answers =
        catalog.ListAnswers(r.round);
    if (!answers.ok()) break;
    for (const flight::FlightAnswer& a : answers->answers) {
      // A rank that dumped as its op failed may exit before it can answer:
      // that dump is its last word.
      if (a.request >= *request || a.reason == "failed" ||
          a.reason == "timeout") {
        waiting.erase(a.rank);
      }
    }
    if (!waiting.empty()) absl::SleepFor(options_.poll_interval);
  }
  if (waiting.empty()) {
    Log(absl::StrCat("round ", r.round, ": flight records in cohortd (",
                     "cohortctl diagnose ", options_.run_id,
                     " --request_dump=false)"));
  } else {
    Log(absl::StrCat("round ", r.round, ": no flight records from ",
                     waiting.size() == 1 ? "rank " : "ranks ",
                     absl::StrJoin(waiting, ","), " within ",
                     absl::FormatDuration(options_.flight_dump_wait)));
  }
}

absl::StatusOr<int> Launcher::BindTorchStore(const RendezvousResult& r) {
  const std::string name_space = StoreNamespace(options_.run_id, r.round);
  if (proxy_ == nullptr) {
    TcpStoreProxyOptions proxy;
    proxy.upstream = options_.tcpstore;
    proxy.name_space = name_space;
    proxy.token = options_.store_token;
    proxy.log = [this](absl::string_view line) { Log(std::string(line)); };
    absl::StatusOr<std::unique_ptr<TcpStoreProxy>> started =
        TcpStoreProxy::Start(std::move(proxy));
    if (!started.ok()) return started.status();
    proxy_ = *std::move(started);
  } else if (absl::Status s = proxy_->SetNamespace(name_space); !s.ok()) {
    return s;
  }
  Log(absl::StrCat("round ", r.round,
                   ": workers' torch store 127.0.0.1:", proxy_->port(),
                   " is cohortd's ", options_.tcpstore, " under ", name_space));
  return proxy_->port();
}

std::vector<WorkerSpec> Launcher::WorkerSpecs(const Round& round,
                                              int restart_count,
                                              int store_port) const {
  const RendezvousResult& r = round.rendezvous;
  // What torchrun's agent sets (torch/distributed/elastic/agent/server/
  // local_elastic_agent.py), with one role, "default". torch names the
  // workers' keys /worker/attempt_<TORCHELASTIC_RESTART_COUNT>, so that
  // count must agree across nodes: it is the round, which does, and which
  // counts scale-up rounds too (COHORT_RESTART_COUNT counts failures).
  std::vector<std::pair<std::string, std::string>> common = {
      {"WORLD_SIZE", absl::StrCat(r.world_size)},
      {"LOCAL_WORLD_SIZE", absl::StrCat(options_.nproc_per_node)},
      {"GROUP_RANK", absl::StrCat(r.node_rank)},
      {"GROUP_WORLD_SIZE", absl::StrCat(r.num_nodes)},
      {"ROLE_NAME", "default"},
      {"ROLE_WORLD_SIZE", absl::StrCat(r.world_size)},
      {"TORCHELASTIC_RESTART_COUNT", absl::StrCat(r.round)},
      {"TORCHELASTIC_MAX_RESTARTS", absl::StrCat(options_.max_restarts)},
      {"TORCHELASTIC_RUN_ID", options_.run_id},
      {"COHORT_ADDR", options_.coordinator},
      {"COHORT_RUN_ID", options_.run_id},
      {"COHORT_ROUND", absl::StrCat(r.round)},
      {"COHORT_STORE_PREFIX", r.store_prefix},
      {"COHORT_RESTART_COUNT", absl::StrCat(restart_count)},
      // This node's membership in the run's group, which a worker may
      // report an asynchronous failure through (InitProcessGroup's NCCL
      // watchdog does) before it exits.
      {"COHORT_MEMBER_GROUP", options_.run_id},
      {"COHORT_MEMBER_NAME", options_.node_id},
      {"COHORT_MEMBER_INCARNATION", absl::StrCat(round.member->incarnation())},
  };
  if (!options_.no_torch_store) {
    common.emplace_back("MASTER_ADDR", "127.0.0.1");
    common.emplace_back("MASTER_PORT", absl::StrCat(store_port));
    common.emplace_back("TORCHELASTIC_USE_AGENT_STORE", "True");
  }
  // Defaults that a value in cohortrun's own environment overrides.
  for (const char* name :
       {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"}) {
    if (!InEnvironment(name)) common.emplace_back(name, "1");
  }
  if (!InEnvironment("OMP_NUM_THREADS") && options_.nproc_per_node > 1) {
    common.emplace_back("OMP_NUM_THREADS", "1");
  }
  for (const auto& entry : options_.worker_env) common.push_back(entry);
  // The torch store's variables go even when no torch store is given: one
  // inherited from cohortrun's environment would point elsewhere.
  absl::flat_hash_set<std::string> replaced = {
      "RANK",        "LOCAL_RANK",  "ROLE_RANK",
      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"};
  for (const auto& [name, value] : common) replaced.insert(name);
  std::vector<std::string> inherited;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    absl::string_view e(*entry);
    if (!replaced.contains(e.substr(0, e.find('=')))) inherited.emplace_back(e);
  }

  std::vector<WorkerSpec> specs;
  for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
    WorkerSpec spec;
    spec.rank = r.first_global_rank + local_rank;
    spec.local_rank = local_rank;
    spec.environment = inherited;
    spec.environment.push_back(absl::StrCat("RANK=", spec.rank));
    spec.environment.push_back(absl::StrCat("LOCAL_RANK=", local_rank));
    spec.environment.push_back(absl::StrCat("ROLE_RANK=", spec.rank));
    for (const auto& [name, value] : common) {
      spec.environment.push_back(absl::StrCat(name, "=", value));
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

std::optional<std::string> Launcher::PeerTrouble(const Round& round) {
  absl::Status health = round.member->health();
  if (!health.ok()) {
    // Peers have seen (or will see) this node fail and restart without it.
    return absl::StrCat("this node lost its membership in group ",
                        options_.run_id, ": ", health.message());
  }
  std::deque<MemberEvent> events;
  {
    absl::MutexLock lock(&mu_);
    events.swap(events_);
  }
  for (const MemberEvent& event : events) {
    auto it = round.peer_incarnations.find(event.member.name);
    // This node's own events, nodes outside the round, and earlier
    // incarnations of the round's nodes (their previous rounds) are history.
    if (it == round.peer_incarnations.end() ||
        it->second != event.member.incarnation) {
      continue;
    }
    // The peer's name and what it reported are its own text, printed by
    // this node: escaped, so that a peer cannot forge this node's log lines.
    const std::string peer =
        absl::StrCat("peer ", base::Escape(event.member.name));
    switch (event.type) {
      case MemberEvent::Type::kJoined:
        break;
      case MemberEvent::Type::kLeft:
        return absl::StrCat(peer, " left the group");
      case MemberEvent::Type::kFailed:
        return absl::StrCat(peer,
                            " failed: ", base::Escape(event.message, 4096));
      case MemberEvent::Type::kErrorReported:
        return absl::StrCat(
            peer, " reported an error: ", base::Escape(event.message, 4096));
    }
  }
  return std::nullopt;
}

std::optional<std::string> Launcher::NodesWaiting(const Round& round) {
  const RendezvousResult& r = round.rendezvous;
  // A full round has no room for waiting nodes: they wait for a failure.
  if (r.num_nodes >= options_.max_nodes) return std::nullopt;
  absl::StatusOr<RunStatus> status = rendezvous_->GetRunStatus(options_.run_id);
  // cohortd briefly away: if a peer failed meanwhile, the group says so.
  if (!status.ok()) return std::nullopt;
  if (status->round == r.round && status->num_waiting > 0) {
    return absl::StrCat(Plural(status->num_waiting, "node"),
                        " waiting to join run ", options_.run_id, " (round ",
                        r.round, " has ", r.num_nodes, " of at most ",
                        options_.max_nodes, ")");
  }
  if (status->round > r.round) {
    return absl::StrCat("run ", options_.run_id, " moved on to round ",
                        status->round);
  }
  return std::nullopt;
}

int Launcher::Finish(Round& round) {
  const RendezvousResult& r = round.rendezvous;
  Log(absl::StrCat("round ", r.round, ": all ",
                   Plural(options_.nproc_per_node, "worker"), " exited 0"));
  if (r.num_nodes > 1) {
    std::vector<std::string> nodes;
    for (const RendezvousPeer& peer : r.peers) nodes.push_back(peer.node_id);
    const std::string waiting = absl::StrCat(
        "waiting up to ", absl::FormatDuration(options_.exit_barrier_timeout),
        " for the other ", Plural(r.num_nodes - 1, "node"), " to finish");
    if (BeginBlocking(waiting)) {
      Log(absl::StrCat("round ", r.round, ": ", waiting));
      absl::Status all_done = round.member->Barrier(
          absl::StrCat("cohortrun.round-", r.round, ".exit"),
          options_.exit_barrier_timeout, nodes);
      EndBlocking();
      // This node's work is done either way; a peer that failed restarts
      // (or gives up) on its own, as with torchrun.
      if (all_done.ok()) {
        Log(absl::StrCat("round ", r.round, ": all ",
                         Plural(r.num_nodes, "node"), " finished"));
      } else {
        Log(absl::StrCat("not all nodes finished (", all_done.ToString(),
                         "); this node's workers succeeded"));
      }
    }
  }
  Leave(round);
  return 0;
}

void Launcher::Leave(Round& round) {
  if (round.member == nullptr) return;
  absl::Status left = round.member->Leave();
  if (!left.ok()) {
    Log(absl::StrCat("leaving group ", options_.run_id, ": ", left.ToString()));
  }
  round.member.reset();
}

void Launcher::OnMemberEvent(const MemberEvent& event) {
  absl::MutexLock lock(&mu_);
  events_.push_back(event);
}

bool Launcher::HasNews() const { return stop_signal_ != 0 || !events_.empty(); }

bool Launcher::BeginBlocking(const std::string& what) {
  absl::MutexLock lock(&mu_);
  if (stop_signal_ != 0) return false;
  blocked_in_ = what;
  return true;
}

void Launcher::EndBlocking() {
  absl::MutexLock lock(&mu_);
  blocked_in_.clear();
}

int Launcher::stop_signal() const {
  absl::MutexLock lock(&mu_);
  return stop_signal_;
}

void Launcher::Log(const std::string& line) const { options_.log(line); }

}  // namespace cohort

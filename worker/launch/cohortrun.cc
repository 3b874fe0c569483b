// cohortrun: starts a node's worker processes for a distributed job, the
// torchrun of cohort. The logic is in worker/launch/launcher.h; this file
// reads the command line and hands signals to the launcher.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/net.h"
#include "base/signals.h"
#include "client/auth_client.h"
#include "client/info_client.h"
#include "client/membership_client.h"
#include "client/remote_store.h"
#include "client/rendezvous_client.h"
#include "worker/launch/launcher.h"
#include "worker/launch/torch_store.h"

ABSL_FLAG(std::string, coordinator, "",
          "cohortd HOST:PORT; default $COHORT_ADDR, else localhost:29500");
ABSL_FLAG(std::string, tcpstore, "",
          "cohortd's TCPStore listener HOST:PORT, where workers' torch stores "
          "go; default $COHORT_TCPSTORE, else where cohortd says it is "
          "(cohort.v1.Info). Checked before any worker starts");
ABSL_FLAG(absl::Duration, tcpstore_check_timeout, absl::Seconds(5),
          "how long the start-up check of the TCPStore listener waits for "
          "each TCP connect, and then for its answers");
ABSL_FLAG(std::string, run_id, "", "the job's id, the same on every node");
ABSL_FLAG(std::string, nnodes, "1",
          "nodes in the job: N, or MIN:MAX for an elastic job");
ABSL_FLAG(int, nproc_per_node, 1, "worker processes on this node");
ABSL_FLAG(int, max_restarts, 0,
          "restarts after a worker or node failure before giving up");
ABSL_FLAG(bool, tee, false,
          "prefix each line the workers write with \"[rank N] \"");
ABSL_FLAG(std::string, node_id, "",
          "this node's id in the job (node ranks follow their order); "
          "default <hostname>-<pid>");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Seconds(5),
          "heartbeat interval of this node's group membership; peers declare "
          "it failed after 3 missed heartbeats");
ABSL_FLAG(absl::Duration, stop_grace, absl::Seconds(5),
          "time workers get between SIGTERM and SIGKILL");
ABSL_FLAG(absl::Duration, join_timeout, absl::Seconds(600),
          "how long a rendezvous round may wait for MIN nodes");
ABSL_FLAG(absl::Duration, last_call_timeout, absl::Seconds(30),
          "once MIN nodes have joined, how long a round waits for more");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA that signed cohortd's certificate: connect with TLS; "
          "default $COHORT_TLS_CA. Workers get it as COHORT_TLS_CA");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM client certificate for a cohortd with --tls_client_ca; "
          "default $COHORT_TLS_CERT. Workers get it as COHORT_TLS_CERT");
ABSL_FLAG(std::string, tls_key, "",
          "PEM key of --tls_cert; default $COHORT_TLS_KEY");
ABSL_FLAG(std::string, token_file, "",
          "file whose first line is this job's token; default $COHORT_TOKEN, "
          "else the file $COHORT_TOKEN_FILE names. With a token, cohortrun "
          "mints one for its workers, valid for this run alone");
ABSL_FLAG(absl::Duration, worker_token_ttl, absl::Hours(24 * 7),
          "lifetime of the workers' token (revoked when cohortrun exits; "
          "this bounds it if cohortrun is killed)");
ABSL_FLAG(absl::Duration, exit_barrier_timeout, absl::Seconds(300),
          "how long a node whose workers succeeded waits for its peers");

namespace {

// The token cohortrun gives its workers: rw on this run alone (prefix
// "RUN_ID/", which covers the run, its group and its keys), minted with
// cohortrun's own token and revoked when cohortrun exits, so a worker never
// holds the job's (or an admin's) token.
class WorkerToken {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerToken>> Mint(
      const cohort::ConnectionOptions& connection, const std::string& run_id,
      absl::Duration ttl) {
    auto client = cohort::AuthClient::Connect(connection);
    if (!client.ok()) return client.status();
    auto me = (*client)->WhoAmI();
    if (!me.ok()) {
      return absl::Status(
          me.status().code(),
          absl::StrCat("checking this job's token with cohortd "
                       "at ",
                       connection.address, ": ", me.status().message()));
    }
    const std::string prefix = absl::StrCat(run_id, "/");
    if (me->prefix() != "*" && !absl::StartsWith(prefix, me->prefix())) {
      return absl::PermissionDeniedError(
          absl::StrCat("the token grants prefix '", me->prefix(),
                       "', which does not "
                       "cover run '",
                       run_id,
                       "': name the run inside it (run ids have no "
                       "'/'), e.g. --run-id=",
                       absl::EndsWith(me->prefix(), "/")
                           ? me->prefix().substr(0, me->prefix().size() - 1)
                           : absl::StrCat(me->prefix(), run_id)));
    }
    char host[256] = "";
    gethostname(host, sizeof(host) - 1);
    auto issued =
        (*client)->Issue("rw", prefix, ttl,
                         absl::StrCat("workers of run ", run_id, " on ", host,
                                      " (cohortrun ", getpid(), ")"));
    if (!issued.ok()) {
      return absl::Status(
          issued.status().code(),
          absl::StrCat(
              "minting the workers' token: ", issued.status().message(),
              " (cohortrun needs a rw or admin token)"));
    }
    return std::unique_ptr<WorkerToken>(
        new WorkerToken(*std::move(client), issued->token(), issued->id()));
  }

  ~WorkerToken() {
    absl::Status revoked = client_->Revoke(id_);
    if (!revoked.ok() && !absl::IsNotFound(revoked)) {
      std::fprintf(stderr,
                   "cohortrun: could not revoke the workers' token %s: %s "
                   "(it expires by itself)\n",
                   id_.substr(0, 12).c_str(),
                   std::string(revoked.message()).c_str());
    }
  }

  const std::string& token() const { return token_; }

 private:
  WorkerToken(std::unique_ptr<cohort::AuthClient> client, std::string token,
              std::string id)
      : client_(std::move(client)),
        token_(std::move(token)),
        id_(std::move(id)) {}

  std::unique_ptr<cohort::AuthClient> client_;
  std::string token_;
  std::string id_;
};

constexpr char kUsage[] =
    R"(cohortrun --run-id=ID [--coordinator=HOST:PORT] [--tcpstore=HOST:PORT]
          [--nnodes=MIN:MAX] [--nproc-per-node=K] [--max-restarts=R] [--tee]
          [--node-id=NAME] [--tls-ca=PEM [--tls-cert=PEM --tls-key=PEM]]
          [--token-file=FILE] -- PROGRAM ARGS...

Joins run ID on cohortd as one node and runs K copies of PROGRAM with the
environment torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_*, ...) and COHORT_ADDR, COHORT_RUN_ID, COHORT_ROUND,
COHORT_STORE_PREFIX and COHORT_RESTART_COUNT. MASTER_ADDR:MASTER_PORT is a
proxy on this node's loopback to cohortd's TCPStore listener, so
dist.init_process_group("gloo") bootstraps through cohortd, with the job's
keys under /cohortrun/ID/ROUND/. cohortrun asks cohortd where that listener
is (--tcpstore overrides it) and checks, before any worker starts, that it
answers and serves this cohortd's keys. When a worker or a node fails, every
node stops its workers and starts them again in a new round, up to R times.
Exits 0 when all of this node's workers exited 0.
With auth on cohortd, give this job's token ($COHORT_TOKEN or --token-file):
the run ID must lie within its prefix, and the workers get a token of their
own, for this run alone, revoked when cohortrun exits.
Flags may be written with '-' or '_' (--nproc-per-node, --nproc_per_node).)";

// Takes the stop signals on a thread of its own and hands them to the
// launcher once there is one. Before that, and while the launcher is
// blocked in a call to cohortd it cannot interrupt, the process exits at
// once: it has no workers to leave behind then.
class SignalThread {
 public:
  explicit SignalThread(const sigset_t& signals)
      : signals_(signals), thread_([this] { Run(); }) {}
  ~SignalThread() { Stop(); }

  // REQUIRES: `launcher` outlives Stop().
  void Forward(cohort::Launcher* launcher) { launcher_ = launcher; }
  // Takes no more signals (they stay pending). Idempotent.
  void Stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Run() {
    const timespec poll = {0, 100 * 1000 * 1000};
    while (!done_) {
      const int signal = sigtimedwait(&signals_, nullptr, &poll);
      if (signal <= 0) continue;
      cohort::Launcher* launcher = launcher_;
      if (launcher == nullptr || !launcher->Stop(signal)) _exit(128 + signal);
    }
  }

  const sigset_t signals_;
  std::atomic<cohort::Launcher*> launcher_{nullptr};
  std::atomic<bool> done_{false};
  std::thread thread_;  // Last: starts once the rest is built.
};

int Usage(const std::string& problem) {
  std::fprintf(stderr, "cohortrun: %s\n\n%s\n", problem.c_str(), kUsage);
  return 2;
}

// torchrun's flags are spelled with dashes; Abseil's cannot be. Rewrites
// the names (not the values) of the flags before "--".
std::vector<std::string> DashesToUnderscores(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--") break;
    if (!absl::StartsWith(arg, "-")) continue;
    size_t name_start = arg.find_first_not_of('-');
    size_t name_end = std::min(arg.find('='), arg.size());
    for (size_t c = name_start; c < name_end; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  return args;
}

// Where the flags and the environment say cohortd's TCPStore listener is.
struct TcpStoreGiven {
  std::string flag;  // --tcpstore
  std::string env;   // $COHORT_TCPSTORE
};

TcpStoreGiven TcpStoreFromFlags() {
  const char* env = std::getenv("COHORT_TCPSTORE");
  return {absl::GetFlag(FLAGS_tcpstore), env != nullptr ? env : ""};
}

// The launcher's options from the flags, the program being what follows
// "--" in `positional`. A usage problem (exit 2) for one missing or wrong.
absl::StatusOr<cohort::LauncherOptions> LauncherFromFlags(
    const std::vector<char*>& positional, const TcpStoreGiven& tcpstore) {
  cohort::LauncherOptions options;
  options.command.assign(positional.begin() + 1, positional.end());
  auto usage = [](absl::string_view problem) {
    return absl::InvalidArgumentError(problem);
  };
  if (options.command.empty()) return usage("no program given after --");
  options.run_id = absl::GetFlag(FLAGS_run_id);
  if (options.run_id.empty()) return usage("--run-id is required");
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  if (options.coordinator.empty()) {
    const char* env = std::getenv("COHORT_ADDR");
    options.coordinator =
        env != nullptr && *env != '\0' ? env : cohort::kDefaultAddress;
  }
  if (auto split = cohort::base::SplitHostPort(options.coordinator);
      !split.ok()) {
    return usage(absl::StrCat("--coordinator: ", split.status().message()));
  }
  for (const auto& [name, given] :
       {std::pair{"--tcpstore", tcpstore.flag},
        std::pair{"$COHORT_TCPSTORE", tcpstore.env}}) {
    if (given.empty()) continue;
    if (auto split = cohort::base::SplitHostPort(given); !split.ok()) {
      return usage(absl::StrCat(name, ": ", split.status().message()));
    }
  }
  auto nodes = cohort::ParseNodeRange(absl::GetFlag(FLAGS_nnodes));
  if (!nodes.ok()) {
    return usage(absl::StrCat("--nnodes: ", nodes.status().message()));
  }
  options.min_nodes = nodes->first;
  options.max_nodes = nodes->second;
  options.nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
  if (options.nproc_per_node < 1) return usage("--nproc-per-node must be >= 1");
  options.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  if (options.max_restarts < 0) return usage("--max-restarts must be >= 0");
  options.tee = absl::GetFlag(FLAGS_tee);
  options.node_id = absl::GetFlag(FLAGS_node_id);
  options.heartbeat_interval = absl::GetFlag(FLAGS_heartbeat_interval);
  options.stop_grace = absl::GetFlag(FLAGS_stop_grace);
  options.join_timeout = absl::GetFlag(FLAGS_join_timeout);
  options.last_call_timeout = absl::GetFlag(FLAGS_last_call_timeout);
  options.exit_barrier_timeout = absl::GetFlag(FLAGS_exit_barrier_timeout);
  return options;
}

// How cohortrun reaches cohortd: the flags, then the environment's
// credentials. The workers get the same TLS files, as absolute paths, in
// options.worker_env. A usage problem (exit 2) for a bad token file or
// credentials.
absl::StatusOr<cohort::ConnectionOptions> ConnectionFromFlags(
    cohort::LauncherOptions& options) {
  cohort::ConnectionOptions connection;
  connection.address = options.coordinator;
  // Ride out a cohortd replica's failover (a few seconds) on calls that
  // are safe to repeat, such as joining the rendezvous.
  connection.max_attempts = 40;
  connection.max_backoff = absl::Seconds(1);
  connection.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  connection.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  connection.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  if (const std::string file = absl::GetFlag(FLAGS_token_file); !file.empty()) {
    absl::StatusOr<std::string> token =
        cohort::ReadTokenFile(file, "--token-file");
    if (!token.ok()) return token.status();
    connection.token = *std::move(token);
  }
  auto credentials = cohort::WithEnvironmentCredentials(connection);
  if (!credentials.ok()) return credentials.status();
  connection = *std::move(credentials);
  // Workers reach cohortd as cohortrun does, but with their own token.
  for (auto [name, file] :
       {std::pair{"COHORT_TLS_CA", connection.tls_ca_file},
        std::pair{"COHORT_TLS_CERT", connection.tls_cert_file},
        std::pair{"COHORT_TLS_KEY", connection.tls_key_file},
        std::pair{"COHORT_TLS_SERVER_NAME", connection.tls_server_name}}) {
    if (file.empty()) continue;
    std::error_code ec;
    std::filesystem::path absolute = std::filesystem::absolute(file, ec);
    options.worker_env.emplace_back(name, ec ? file : absolute.string());
  }
  return connection;
}

// With a token of cohortrun's own, mints the workers' and puts it in their
// environment (and the node proxy's hellos); null without one.
absl::StatusOr<std::unique_ptr<WorkerToken>> GiveWorkersAToken(
    const cohort::ConnectionOptions& connection,
    cohort::LauncherOptions& options) {
  if (connection.token.empty()) return nullptr;
  auto minted = WorkerToken::Mint(connection, options.run_id,
                                  absl::GetFlag(FLAGS_worker_token_ttl));
  if (!minted.ok()) return minted.status();
  options.worker_env.emplace_back("COHORT_TOKEN", (*minted)->token());
  options.store_token = (*minted)->token();
  options.worker_env.emplace_back("COHORT_TOKEN_FILE", "");
  return minted;
}

// Where the workers' torch stores go, checked before any worker starts: a
// wrong address fails here, in seconds, saying why. Sets options.tcpstore,
// or options.no_torch_store when cohortd serves no TCPStore listener.
absl::Status SetUpTorchStore(const cohort::ConnectionOptions& connection,
                             const TcpStoreGiven& tcpstore,
                             cohort::LauncherOptions& options) {
  auto info_client = cohort::InfoClient::Connect(connection);
  absl::StatusOr<cohort::v1::ServerInfo> info =
      info_client.ok()
          ? (*info_client)->GetServerInfo()
          : absl::StatusOr<cohort::v1::ServerInfo>(info_client.status());
  absl::StatusOr<cohort::TorchStoreLocation> torch_store =
      cohort::LocateTorchStore(tcpstore.flag, tcpstore.env, options.coordinator,
                               info);
  if (!torch_store.ok()) return torch_store.status();
  if (torch_store->address.empty()) {
    std::fprintf(stderr,
                 "cohortrun: the workers get no torch store (no MASTER_ADDR, "
                 "MASTER_PORT): %s. torch.distributed's env:// cannot "
                 "bootstrap; give cohortd --tcpstore_listen=HOST:PORT for "
                 "PyTorch jobs\n",
                 torch_store->source.c_str());
    options.no_torch_store = true;
    return absl::OkStatus();
  }
  auto grpc_store = cohort::RemoteStore::Connect(connection);
  absl::StatusOr<std::string> checked =
      grpc_store.ok()
          ? cohort::CheckTorchStore(
                **grpc_store, *torch_store,
                {.run_id = options.run_id,
                 .token = options.store_token,
                 .timeout = absl::GetFlag(FLAGS_tcpstore_check_timeout)})
          : absl::StatusOr<std::string>(grpc_store.status());
  if (!checked.ok()) return checked.status();
  std::fprintf(stderr, "cohortrun: %s\n", checked->c_str());
  options.tcpstore = torch_store->address;
  return absl::OkStatus();
}

// Runs the job on this node, stop signals forwarded to the launcher; the
// exit status. 1 when cohortd cannot be reached.
int RunLauncher(const cohort::ConnectionOptions& connection,
                cohort::LauncherOptions options, SignalThread& signals) {
  auto rendezvous = cohort::RendezvousClient::Connect(connection);
  auto membership = cohort::MembershipClient::Connect(connection);
  for (const absl::Status& status :
       {rendezvous.status(), membership.status()}) {
    if (!status.ok()) {
      std::fprintf(stderr, "cohortrun: cannot reach cohortd at %s: %s\n",
                   options.coordinator.c_str(), status.ToString().c_str());
      return 1;
    }
  }
  // For flight dumps when a round fails; the job runs without them.
  auto store = cohort::RemoteStore::Connect(connection);
  if (store.ok()) {
    options.store = std::shared_ptr<cohort::Store>(*std::move(store));
  } else {
    std::fprintf(stderr, "cohortrun: no flight dumps on failure: %s\n",
                 store.status().ToString().c_str());
  }
  cohort::Launcher launcher(std::move(options), *std::move(rendezvous),
                            *std::move(membership));
  signals.Forward(&launcher);
  const int status = launcher.Run();
  signals.Stop();  // Before `launcher` goes.
  return status;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "cohortrun: %s\n",
               std::string(status.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Before any thread (gRPC's included) starts, so that every thread
  // inherits the mask and one takes the signals with sigtimedwait to hand
  // them to the launcher; workers unblock them before exec.
  const sigset_t stop_signals = cohort::base::BlockStopSignals();
  // A closed stdout must not kill the launcher of running workers.
  signal(SIGPIPE, SIG_IGN);
  absl::SetProgramUsageMessage(kUsage);
  std::vector<std::string> args = DashesToUnderscores(argc, argv);
  std::vector<char*> arg_ptrs;
  for (std::string& arg : args) arg_ptrs.push_back(arg.data());
  const std::vector<char*> positional =
      absl::ParseCommandLine(arg_ptrs.size(), arg_ptrs.data());

  const TcpStoreGiven tcpstore = TcpStoreFromFlags();
  absl::StatusOr<cohort::LauncherOptions> options =
      LauncherFromFlags(positional, tcpstore);
  if (!options.ok()) return Usage(std::string(options.status().message()));
  absl::StatusOr<cohort::ConnectionOptions> connection =
      ConnectionFromFlags(*options);
  if (!connection.ok()) {
    return Usage(std::string(connection.status().message()));
  }
  // From the first call to cohortd on, a stop signal ends cohortrun.
  SignalThread signals(stop_signals);
  absl::StatusOr<std::unique_ptr<WorkerToken>> worker_token =
      GiveWorkersAToken(*connection, *options);
  if (!worker_token.ok()) return Fail(worker_token.status());
  if (absl::Status s = SetUpTorchStore(*connection, tcpstore, *options);
      !s.ok()) {
    return Fail(s);
  }
  const int status = RunLauncher(*connection, *std::move(options), signals);
  worker_token->reset();  // Revokes it.
  return status;
}

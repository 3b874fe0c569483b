// cohortd: the cohort coordinator. Serves the KV store, rendezvous and
// membership (cohort.v1.Store, Rendezvous and Membership, plus
// grpc.health.v1 and server reflection) over gRPC, and the same keys over
// PyTorch's TCPStore protocol (--tcpstore_listen). Backed by RocksDB in
// --data_dir or, with --engine=memory, by nothing durable.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/log_limiter.h"
#include "base/net.h"
#include "base/signals.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/support/log.h"
#include "proto/c10d/rules.h"
#include "server/cohort_server.h"
#include "server/ha/etcd_engine.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:29500",
          "HOST:PORT to serve on; port 0 picks a free one");
ABSL_FLAG(std::string, tcpstore_listen, "0.0.0.0:29400",
          "HOST:PORT to serve PyTorch's TCPStore protocol on (torch clients "
          "and torchrun --rdzv_backend=c10d); 29400 is torchrun's default "
          "c10d port; empty turns it off");
ABSL_FLAG(std::string, tcpstore_advertise, "",
          "HOST:PORT at which clients dial the TCPStore listener when it is "
          "not where it is bound (a Kubernetes Service, a NAT): what "
          "cohort.v1.Info reports, and so where cohortrun points its "
          "workers. Default: the bound address; bound to 0.0.0.0 or [::], "
          "the host each caller dialed cohortd's gRPC port with");
ABSL_FLAG(std::vector<std::string>, tcpstore_allow, {},
          "comma-separated peer networks (CIDR, as 10.0.0.0/8,fd00::/8, or "
          "single addresses) whose TCPStore connections are served; others "
          "are closed at once and logged. Empty: every peer. The protocol "
          "has no credentials: this, the bind address and --tcpstore_prefix "
          "are its access control");
ABSL_FLAG(std::string, tcpstore_prefix, "",
          "every TCPStore connection's keys live under this prefix (a "
          "namespace hello's namespace comes after it), so the listener can "
          "reach nothing else of the store; empty: the whole store");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain to serve gRPC over TLS with (with "
          "--tls_key); re-read when the file changes or on SIGHUP");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: clients must present a certificate it signed "
          "(mutual TLS)");
ABSL_FLAG(std::string, auth_tokens, "",
          "tokens file: one \"TOKEN ROLE PREFIX\" a line, ROLE r, rw or "
          "admin (PREFIX *), # comments; re-read when it changes or on "
          "SIGHUP. Every call then needs a token (authorization: Bearer "
          "TOKEN), and the TCPStore listener, which cannot carry one, is off "
          "unless --tcpstore_listen is given explicitly");
ABSL_FLAG(std::string, health_listen, "",
          "HOST:PORT of a plaintext port serving only grpc.health.v1 (for "
          "Kubernetes' gRPC probes when --listen serves TLS); empty: none");
ABSL_FLAG(absl::Duration, max_token_ttl, absl::Hours(24 * 30),
          "with --auth_tokens: the longest lifetime of an issued token "
          "(IssueToken's ttl 0 gets it)");
ABSL_FLAG(double, token_issue_rate, 100,
          "with --auth_tokens: tokens a file token and every token issued "
          "under it may issue a second, together (0: no limit); over it "
          "IssueToken is RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, token_issue_burst, 1000,
          "with --auth_tokens: how many tokens they may issue at once before "
          "--token_issue_rate applies (a cohortrun job mints one per node)");
ABSL_FLAG(int64_t, max_issued_tokens, 10000,
          "with --auth_tokens: issued tokens alive at once under one file "
          "token, at any depth (0: no limit)");
ABSL_FLAG(absl::Duration, token_sweep_interval, absl::Minutes(1),
          "with --auth_tokens: how often the records of expired and orphaned "
          "issued tokens are deleted from the store");
ABSL_FLAG(bool, tcpstore_require_token, true,
          "with --auth_tokens: the TCPStore listener serves only connections "
          "whose hello carries a token covering their namespace (cohortrun's "
          "node proxy sends its workers' token); false serves anonymous "
          "torch clients on the strength of --tcpstore_allow and "
          "--tcpstore_prefix alone");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT (or :PORT for every interface) to serve Prometheus "
          "metrics on, at /metrics, and the live status page, at / (JSON "
          "at /api/status); port 0 picks a free one; empty turns both off");
ABSL_FLAG(std::string, data_dir, "./cohort-data",
          "folder holding the RocksDB database (--engine=rocksdb)");
ABSL_FLAG(std::string, engine, "rocksdb",
          "storage engine: rocksdb (durable), memory (lost on exit) or etcd "
          "(in the etcd cluster of --etcd_endpoints, shared by every cohortd "
          "replica pointed at it)");
ABSL_FLAG(std::vector<std::string>, etcd_endpoints, {},
          "--engine=etcd: the cluster's client endpoints, HOST:PORT,...");
ABSL_FLAG(std::string, etcd_prefix, "/cohort/kv/",
          "--engine=etcd: the etcd key prefix every key is stored under");
ABSL_FLAG(std::string, advertise, "",
          "--engine=etcd: HOST:PORT at which the other replicas reach this "
          "one (they pass rendezvous and membership calls on to the elected "
          "leader); default: --listen's, with this host's name for 0.0.0.0");
ABSL_FLAG(absl::Duration, election_ttl, absl::Seconds(3),
          "--engine=etcd: the leader's etcd lease; a dead leader is replaced "
          "within about this long");
ABSL_FLAG(bool, sync_writes, false,
          "fsync the write-ahead log on every mutation: survives power loss, "
          "costs one fsync per write. Without it, writes survive a killed "
          "cohortd but not a crashed machine");
ABSL_FLAG(uint64_t, max_key_bytes, cohort::c10d::Limits().max_key_bytes,
          "largest key accepted, in bytes");
ABSL_FLAG(uint64_t, max_value_bytes, cohort::c10d::Limits().max_value_bytes,
          "largest value accepted (also the largest Append result), in bytes");
ABSL_FLAG(uint64_t, max_keys_per_call, cohort::c10d::Limits().max_keys_per_call,
          "most keys one Wait/Check/MultiGet/MultiSet may name");
ABSL_FLAG(uint64_t, max_list_page, 10000,
          "most keys one ListKeys page returns");
ABSL_FLAG(uint64_t, watch_history_events, 100000,
          "changes kept in memory so a Watch can resume from a past revision");
ABSL_FLAG(uint64_t, watch_history_bytes, 64 << 20,
          "bytes of changes kept for resuming watches");
ABSL_FLAG(uint64_t, watch_buffer_bytes, 64 << 20,
          "unsent bytes after which a slow watcher is cut off "
          "(RESOURCE_EXHAUSTED)");
ABSL_FLAG(uint64_t, min_free_bytes, 64 << 20,
          "free space kept in reserve on the data dir's disk: writes that "
          "would leave less are refused with RESOURCE_EXHAUSTED (deletes "
          "still work), and health turns NOT_SERVING until space is freed");
ABSL_FLAG(uint64_t, max_connections, 16384,
          "client connections open at once, on the gRPC and TCPStore "
          "listeners together; more are refused with a message saying so "
          "(lowered to fit the file descriptor limit)");
ABSL_FLAG(uint64_t, tcpstore_max_unsent_bytes_total, 256 << 20,
          "TCPStore replies queued for all connections together: past it, "
          "only connections with nothing queued are served, and those whose "
          "peers do not read their replies are closed, the largest first");
ABSL_FLAG(uint64_t, tcpstore_max_queue_bytes, 1 << 30,
          "bytes in all TCPStore queues (QUEUE_PUSH items in the store, those "
          "kept over a restart included) together; a push past it closes its "
          "connection (each tenant's share is bounded by --quota_queue_bytes)");
ABSL_FLAG(absl::Duration, tcpstore_spin, absl::Microseconds(50),
          "how long the TCPStore loop keeps polling, yielding the CPU between "
          "polls, after a request instead of sleeping: a request arriving "
          "then skips a thread wake-up; 0 always sleeps");
// Quotas: each tenant's share of cohortd (server/auth/quota.h). A tenant is a
// job: a tokens-file token and every token issued under it; with auth off,
// one client connection.
ABSL_FLAG(uint64_t, quota_keys, cohort::store::StoreLimits().quota_keys,
          "with --auth_tokens: keys each job may store under its prefix P, "
          "/cohortrun/P and runs/P together, whichever protocol writes them; "
          "a write past it is refused with RESOURCE_EXHAUSTED (deletes still "
          "work). With auth off there is no bound per client");
ABSL_FLAG(uint64_t, quota_bytes, cohort::store::StoreLimits().quota_bytes,
          "with --auth_tokens: bytes (keys plus values) each job may store, "
          "counted as --quota_keys");
ABSL_FLAG(uint64_t, quota_queue_bytes,
          cohort::server::QuotaLimits().queue_bytes,
          "bytes each tenant may hold in TCPStore queues (QUEUE_PUSH)");
ABSL_FLAG(uint64_t, quota_waits, cohort::server::QuotaLimits().waits,
          "blocking calls each tenant may have parked at once (gRPC Get, "
          "Wait, MultiGet; TCPStore WAIT); more are refused with "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(uint64_t, quota_waited_keys,
          cohort::server::QuotaLimits().waited_keys,
          "keys each tenant's parked calls may name together");
ABSL_FLAG(uint64_t, quota_watch_streams,
          cohort::server::QuotaLimits().watch_streams,
          "gRPC Watch streams each tenant may hold open");
ABSL_FLAG(uint64_t, quota_connections,
          cohort::server::QuotaLimits().connections,
          "TCPStore connections each tenant may hold open");
ABSL_FLAG(absl::Duration, idle_timeout, absl::Minutes(30),
          "close a connection with no call in flight for this long (the "
          "client reconnects on its next call); 0 keeps them forever");
ABSL_FLAG(absl::Duration, keepalive_time,
          cohort::server::ServerOptions().keepalive_time,
          "probe a connection that received nothing for this long with the "
          "kernel's TCP keepalive (answered by the client's kernel, so a busy "
          "or stopped client keeps its calls; gRPC's HTTP/2 pings, which "
          "need the client's threads, are not used); 0: no keepalive");
ABSL_FLAG(absl::Duration, keepalive_timeout,
          cohort::server::ServerOptions().keepalive_timeout,
          "drop a probed connection whose peer's host answers nothing for "
          "this long (a dead or cut-off client is found within "
          "--keepalive_time + --keepalive_timeout, and its blocked calls "
          "end)");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(5),
          "on SIGTERM/SIGINT, how long calls in flight get to finish");

namespace {

void Log(const std::string& message) {
  std::fprintf(
      stderr, "%s cohortd: %s\n",
      absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone())
          .c_str(),
      message.c_str());
  std::fflush(stderr);
}

int Fail(const absl::Status& status) {
  Log(absl::StrCat("fatal: ", status.message()));
  return 1;
}

// Protobuf logs a line for every request it cannot parse (a string field
// that is not UTF-8), which any peer can send by the thousand: escaped
// (nothing a client chooses reaches the terminal raw) and passed on at most
// once a second, like cohortd's own lines about bad input.
class LibraryLog {
 public:
  explicit LibraryLog(std::string library)
      : library_(std::move(library)),
        limiter_([](absl::string_view line) { Log(std::string(line)); },
                 absl::Seconds(1)) {}

  void Pass(absl::string_view message) {
    absl::MutexLock lock(&mu_);
    limiter_.Log(absl::StrCat(library_, ": ", absl::CHexEscape(message)));
  }

 private:
  const std::string library_;
  absl::Mutex mu_;
  cohort::base::LogLimiter limiter_ ABSL_GUARDED_BY(mu_);
};

// gRPC's error lines are escaped but not held back: each one, a header a
// peer sent that gRPC could not parse say, is worth seeing.
void GrpcLog(gpr_log_func_args* args) {
  if (args->severity < GPR_LOG_SEVERITY_ERROR) return;
  Log(absl::StrCat("grpc: ", absl::CHexEscape(args->message)));
}

void ProtobufLog(google::protobuf::LogLevel level, const char* /*file*/,
                 int /*line*/, const std::string& message) {
  if (level == google::protobuf::LOGLEVEL_FATAL) {
    // Protobuf aborts after this: never held back.
    Log(absl::StrCat("protobuf: fatal: ", absl::CHexEscape(message)));
    return;
  }
  static LibraryLog* lines = new LibraryLog("protobuf");
  lines->Pass(message);
}

// Each client connection is a file descriptor: take the hard limit rather
// than the usual soft 1,024, and keep max_connections under what is left
// for the store and gRPC's own needs.
constexpr uint64_t kReservedFds = 256;
uint64_t RaiseFdLimit(uint64_t max_connections) {
  struct rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return max_connections;
  const rlim_t before = limit.rlim_cur;
  if (limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) limit.rlim_cur = before;
  }
  uint64_t fit = limit.rlim_cur > 2 * kReservedFds
                     ? limit.rlim_cur - kReservedFds
                     : limit.rlim_cur / 2;
  Log(absl::StrCat(
      "file descriptor limit ", limit.rlim_cur,
      limit.rlim_cur != before ? absl::StrCat(" (raised from ", before, ")")
                               : std::string(" (the hard limit)"),
      "; serving up to ", std::min(fit, max_connections), " connections",
      fit < max_connections ? absl::StrCat(" (--max_connections=",
                                           max_connections, " does not fit)")
                            : std::string()));
  return std::min(fit, max_connections);
}

// The host part of a listen address ("" for ":PORT"); the whole address
// when it does not parse, for the listener to refuse with its own message.
std::string HostOf(const std::string& listen) {
  absl::StatusOr<cohort::base::HostPort> split = cohort::base::SplitHostPort(
      listen, {.allow_empty_host = true, .allow_port_zero = true});
  if (!split.ok()) return listen;
  return absl::StrContains(split->host, ':')
             ? absl::StrCat("[", split->host, "]")
             : split->host;
}

// Whether --tcpstore_listen was given on the command line (absl keeps that
// to itself).
bool TcpStoreListenGiven(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (absl::StartsWith(arg, "--tcpstore_listen") ||
        absl::StartsWith(arg, "-tcpstore_listen")) {
      return true;
    }
  }
  return false;
}

absl::StatusOr<cohort::store::StoreLimits> LimitsFromFlags() {
  cohort::store::StoreLimits limits;
  limits.max_key_bytes = absl::GetFlag(FLAGS_max_key_bytes);
  limits.max_value_bytes = absl::GetFlag(FLAGS_max_value_bytes);
  limits.max_keys_per_call = absl::GetFlag(FLAGS_max_keys_per_call);
  limits.max_list_page = absl::GetFlag(FLAGS_max_list_page);
  limits.history_events = absl::GetFlag(FLAGS_watch_history_events);
  limits.history_bytes = absl::GetFlag(FLAGS_watch_history_bytes);
  limits.quota_keys = absl::GetFlag(FLAGS_quota_keys);
  limits.quota_bytes = absl::GetFlag(FLAGS_quota_bytes);
  if (limits.max_key_bytes == 0 || limits.max_keys_per_call == 0 ||
      limits.max_list_page == 0) {
    return absl::InvalidArgumentError(
        "--max_key_bytes, --max_keys_per_call and --max_list_page must be > 0");
  }
  return limits;
}

// A storage engine opened as --engine says, and where it keeps its data
// (for the first log line).
struct OpenedEngine {
  std::unique_ptr<cohort::store::KvEngine> engine;
  std::string where;
};

absl::StatusOr<OpenedEngine> OpenRocksDb() {
  std::error_code ec;
  std::filesystem::path dir =
      std::filesystem::absolute(absl::GetFlag(FLAGS_data_dir), ec);
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot create --data_dir ", dir.string(), ": ", ec.message()));
  }
  auto opened = cohort::store::OpenRocksDbEngine(
      {.path = dir.string(),
       .sync_writes = absl::GetFlag(FLAGS_sync_writes),
       .min_free_bytes = absl::GetFlag(FLAGS_min_free_bytes),
       .log = [](absl::string_view line) {
         Log(absl::StrCat("rocksdb: ", line));
       }});
  if (!opened.ok()) return opened.status();
  // Otherwise the first sign of a disk smaller than the reserve would be
  // the first refused write.
  if (absl::Status writable = (*opened)->CheckWritable(); !writable.ok()) {
    Log(absl::StrCat("warning: ", writable.message()));
  }
  return OpenedEngine{
      std::move(*opened),
      absl::StrCat("rocksdb in ", dir.string(),
                   absl::GetFlag(FLAGS_sync_writes) ? " (sync writes)" : "")};
}

absl::StatusOr<OpenedEngine> OpenEngine(const std::string& engine_name) {
  if (engine_name == "memory") {
    return OpenedEngine{cohort::store::NewMemoryEngine(),
                        "memory (nothing is persisted)"};
  }
  if (engine_name == "rocksdb") return OpenRocksDb();
  if (engine_name == "etcd") {
    auto opened = cohort::server::OpenEtcdEngine(
        {.endpoints = absl::GetFlag(FLAGS_etcd_endpoints),
         .prefix = absl::GetFlag(FLAGS_etcd_prefix),
         .log = [](absl::string_view line) { Log(std::string(line)); }});
    if (!opened.ok()) return opened.status();
    return OpenedEngine{
        std::move(*opened),
        absl::StrCat("etcd at ",
                     absl::StrJoin(absl::GetFlag(FLAGS_etcd_endpoints), ","),
                     " under ", absl::GetFlag(FLAGS_etcd_prefix))};
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--engine must be rocksdb, memory or etcd, got '", engine_name, "'"));
}

// Tokens: the file, and the limits on what may be issued.
absl::Status AuthFromFlags(cohort::server::ServerOptions& options) {
  options.auth_tokens = absl::GetFlag(FLAGS_auth_tokens);
  options.max_token_ttl = absl::GetFlag(FLAGS_max_token_ttl);
  if (options.max_token_ttl <= absl::ZeroDuration() ||
      options.max_token_ttl > absl::Hours(24 * 3650)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_token_ttl must be above 0 and at most 3650 days, got ",
        absl::FormatDuration(options.max_token_ttl)));
  }
  options.token_issue_limits = {
      .rate = absl::GetFlag(FLAGS_token_issue_rate),
      .burst = absl::GetFlag(FLAGS_token_issue_burst),
      .max_live = absl::GetFlag(FLAGS_max_issued_tokens)};
  if (!(options.token_issue_limits.rate >= 0) ||
      options.token_issue_limits.burst < 1 ||
      options.token_issue_limits.max_live < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--token_issue_rate must be >= 0 (0: no limit), --token_issue_burst "
        ">= 1 and --max_issued_tokens >= 0 (0: no limit); got ",
        options.token_issue_limits.rate, ", ", options.token_issue_limits.burst,
        " and ", options.token_issue_limits.max_live));
  }
  options.token_sweep_interval = absl::GetFlag(FLAGS_token_sweep_interval);
  if (options.token_sweep_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--token_sweep_interval must be above 0, got ",
                     absl::FormatDuration(options.token_sweep_interval)));
  }
  return absl::OkStatus();
}

// With --engine=etcd: the election, and the address this replica is known
// by (the listen address, with the host name for a wildcard host).
absl::Status ElectionFromFlags(cohort::server::ServerOptions& options) {
  if (options.tls.enabled()) {
    return absl::UnimplementedError(
        "--engine=etcd with --tls_cert is not supported yet: replicas pass "
        "calls to their leader over plaintext");
  }
  options.election_endpoints = absl::GetFlag(FLAGS_etcd_endpoints);
  options.election_ttl = absl::GetFlag(FLAGS_election_ttl);
  options.advertise = absl::GetFlag(FLAGS_advertise);
  if (!options.advertise.empty()) return absl::OkStatus();
  absl::StatusOr<cohort::base::HostPort> listen = cohort::base::SplitHostPort(
      options.listen, {.allow_empty_host = true, .allow_port_zero = true});
  // A bad --listen is the listener's to refuse, in its own words.
  if (!listen.ok()) return absl::OkStatus();
  std::string host = listen->host;
  if (cohort::base::IsWildcardHost(host)) {
    char name[256] = "";
    gethostname(name, sizeof(name) - 1);
    host = name;
  }
  options.advertise = cohort::base::JoinHostPort(host, listen->port);
  return absl::OkStatus();
}

// The TCPStore listener: whether it is served at all, and to whom.
absl::Status TcpStoreFromFlags(cohort::server::ServerOptions& options,
                               bool tcpstore_explicit) {
  options.tcpstore_listen = absl::GetFlag(FLAGS_tcpstore_listen);
  options.tcpstore_advertise = absl::GetFlag(FLAGS_tcpstore_advertise);
  options.tcpstore_require_token = absl::GetFlag(FLAGS_tcpstore_require_token);
  // PyTorch's TCPStore protocol has no credentials: with auth on, the
  // listener would be a way around it, so it is served only when asked.
  if (!options.auth_tokens.empty() && !tcpstore_explicit &&
      !options.tcpstore_listen.empty()) {
    Log("auth is on: not serving the TCPStore protocol (give "
        "--tcpstore_listen to serve it to cohortrun's node proxies, which "
        "send their workers' token)");
    options.tcpstore_listen.clear();
  }
  if (!options.tcpstore_advertise.empty() && options.tcpstore_listen.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tcpstore_advertise=", options.tcpstore_advertise,
        " says where clients dial the TCPStore listener, but it is off (",
        options.auth_tokens.empty()
            ? "--tcpstore_listen is empty"
            : "auth is on and --tcpstore_listen was not given",
        "): give --tcpstore_listen=HOST:PORT, or drop --tcpstore_advertise"));
  }
  options.tcpstore_allow = absl::GetFlag(FLAGS_tcpstore_allow);
  options.tcpstore_prefix = absl::GetFlag(FLAGS_tcpstore_prefix);
  if (!options.auth_tokens.empty() && !options.tcpstore_require_token &&
      !options.tcpstore_listen.empty() && options.tcpstore_prefix.empty()) {
    return absl::InvalidArgumentError(
        "--tcpstore_require_token=false without --tcpstore_prefix would let "
        "every TCPStore client --tcpstore_allow admits read and write every "
        "job's keys and read cohortd's records, around --auth_tokens: give "
        "--tcpstore_prefix=DIR/ to confine anonymous clients to it, or keep "
        "--tcpstore_require_token (cohortrun's node proxy sends its workers' "
        "token)");
  }
  options.tcpstore_max_unsent_bytes_total =
      absl::GetFlag(FLAGS_tcpstore_max_unsent_bytes_total);
  options.tcpstore_max_queue_bytes =
      absl::GetFlag(FLAGS_tcpstore_max_queue_bytes);
  options.tcpstore_spin = absl::GetFlag(FLAGS_tcpstore_spin);
  return absl::OkStatus();
}

absl::StatusOr<cohort::server::ServerOptions> ServerOptionsFromFlags(
    const std::string& engine_name, bool tcpstore_explicit) {
  cohort::server::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.engine = engine_name;
  if (absl::Status auth = AuthFromFlags(options); !auth.ok()) return auth;
  options.tls = {.cert_file = absl::GetFlag(FLAGS_tls_cert),
                 .key_file = absl::GetFlag(FLAGS_tls_key),
                 .client_ca_file = absl::GetFlag(FLAGS_tls_client_ca)};
  options.health_listen = absl::GetFlag(FLAGS_health_listen);
  if (engine_name == "etcd") {
    if (absl::Status election = ElectionFromFlags(options); !election.ok()) {
      return election;
    }
  }
  if (absl::Status tcpstore = TcpStoreFromFlags(options, tcpstore_explicit);
      !tcpstore.ok()) {
    return tcpstore;
  }
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.max_connections = RaiseFdLimit(absl::GetFlag(FLAGS_max_connections));
  options.idle_timeout = absl::GetFlag(FLAGS_idle_timeout);
  options.keepalive_time = absl::GetFlag(FLAGS_keepalive_time);
  options.keepalive_timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  options.log = [](absl::string_view line) { Log(std::string(line)); };
  options.store_service.watch_buffer_bytes =
      absl::GetFlag(FLAGS_watch_buffer_bytes);
  options.quotas = {.queue_bytes = absl::GetFlag(FLAGS_quota_queue_bytes),
                    .waits = absl::GetFlag(FLAGS_quota_waits),
                    .waited_keys = absl::GetFlag(FLAGS_quota_waited_keys),
                    .watch_streams = absl::GetFlag(FLAGS_quota_watch_streams),
                    .connections = absl::GetFlag(FLAGS_quota_connections)};
  return options;
}

// What cohortd serves, and where: its first lines.
void LogServing(const cohort::server::CohortServer& server,
                const cohort::server::ServerOptions& options,
                const std::string& where, int64_t keys, int64_t revision) {
  Log(absl::StrFormat(
      "serving cohort.v1.Store on %s:%d; store: %s; %d keys at revision %d",
      HostOf(options.listen), server.port(), where, keys, revision));
  if (server.tcpstore_port() != 0) {
    Log(absl::StrFormat(
        "serving the TCPStore protocol on %s:%d (PyTorch "
        "1.13-2.0 and 2.1+ clients)%s%s",
        HostOf(options.tcpstore_listen), server.tcpstore_port(),
        options.tcpstore_advertise.empty()
            ? ""
            : absl::StrCat("; clients are told to dial ",
                           options.tcpstore_advertise),
        !options.auth_tokens.empty() && options.tcpstore_require_token
            ? "; each connection needs a token hello "
              "(cohortrun's node proxy)"
            : ""));
  }
  if (server.health_port() != 0) {
    Log(absl::StrFormat("serving grpc.health.v1 in plaintext on %s:%d",
                        HostOf(options.health_listen), server.health_port()));
  }
  if (server.metrics_port() != 0) {
    const std::string metrics_host = HostOf(options.metrics_listen);
    Log(absl::StrFormat("serving Prometheus metrics on http://%s:%d/metrics",
                        metrics_host.empty() ? "0.0.0.0" : metrics_host,
                        server.metrics_port()));
    Log(absl::StrFormat(
        "serving the status page on http://%s:%d/ (JSON at /api/status%s)",
        metrics_host.empty() ? "0.0.0.0" : metrics_host, server.metrics_port(),
        options.auth_tokens.empty() ? ""
                                    : "; needs an admin's or a run's token"));
  }
}

// Serves until SIGTERM or SIGINT (SIGHUP reloads tokens and certificates),
// then drains. cohortd's exit status.
int ServeUntilStopped(std::unique_ptr<cohort::server::CohortServer> server,
                      const sigset_t& stop_signals) {
  int signal = 0;
  for (;;) {
    sigwait(&stop_signals, &signal);
    if (signal != SIGHUP) break;
    absl::Status reloaded = server->Reload();
    Log(reloaded.ok()
            ? std::string("SIGHUP: reloaded")
            : absl::StrCat("SIGHUP: reload failed: ", reloaded.message()));
  }
  Log(absl::StrCat("received ", signal == SIGTERM ? "SIGTERM" : "SIGINT",
                   "; draining: refusing new calls, ending waiters with "
                   "UNAVAILABLE, giving calls in flight ",
                   absl::FormatDuration(absl::GetFlag(FLAGS_shutdown_grace))));
  absl::Status drained = server->Drain(absl::GetFlag(FLAGS_shutdown_grace));
  const int64_t final_revision = server->store().revision();
  server.reset();
  if (absl::IsResourceExhausted(drained)) {
    // The memtable could not be flushed to a full disk; the write-ahead log
    // already holds every acknowledged write.
    Log(absl::StrCat("stopped at revision ", final_revision,
                     " without flushing to disk (", drained.message(),
                     "); every acknowledged write is in the write-ahead log "
                     "and is replayed at the next start"));
    return 0;
  }
  if (!drained.ok()) return Fail(drained);
  Log(absl::StrCat("stopped cleanly at revision ", final_revision));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "cohortd --listen=HOST:PORT --data_dir=DIR [--engine=rocksdb|memory]\n"
      "        [--tls_cert=PEM --tls_key=PEM [--tls_client_ca=PEM]]\n"
      "        [--auth_tokens=FILE] [--health_listen=HOST:PORT]\n"
      "The cohort coordinator: a c10d-style key-value store over gRPC.");
  // Debian builds Abseil without NDEBUG, which leaves absl::Mutex's deadlock
  // detection on: every Lock looks its mutex up, under one global spinlock,
  // in a graph whose index has a fixed 8,171 hash chains and holds every
  // live mutex ever locked. With a mutex per call in flight (gRPC's and
  // ours) each Lock costs O(calls / 8171), so N parked calls cost O(N^2):
  // at 30,000 members it was 18% of a barrier's CPU. Tests keep the check;
  // the server does without it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const bool tcpstore_explicit = TcpStoreListenGiven(argc, argv);
  absl::ParseCommandLine(argc, argv);
  gpr_set_log_function(GrpcLog);
  google::protobuf::SetLogHandler(ProtobufLog);

  // Signals are taken synchronously by sigwait below; block them before any
  // thread starts so every thread inherits the mask.
  sigset_t stop_signals = cohort::base::BlockStopSignals();
  sigaddset(&stop_signals, SIGHUP);  // Reload tokens and certificates.
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::StatusOr<cohort::store::StoreLimits> limits = LimitsFromFlags();
  if (!limits.ok()) return Fail(limits.status());
  // Before the store is opened: a bad address is a mistake to fix first.
  if (const std::string advertise = absl::GetFlag(FLAGS_tcpstore_advertise);
      !advertise.empty()) {
    absl::Status dialable =
        cohort::server::CheckDialAddress("--tcpstore_advertise", advertise);
    if (!dialable.ok()) return Fail(dialable);
  }

  const std::string engine_name = absl::GetFlag(FLAGS_engine);
  absl::StatusOr<OpenedEngine> opened = OpenEngine(engine_name);
  if (!opened.ok()) return Fail(opened.status());
  const int64_t keys = opened->engine->NumKeys();
  auto store = std::make_unique<cohort::store::KvStore>(
      std::move(opened->engine), *limits);
  const int64_t revision = store->revision();

  absl::StatusOr<cohort::server::ServerOptions> options =
      ServerOptionsFromFlags(engine_name, tcpstore_explicit);
  if (!options.ok()) return Fail(options.status());
  auto server = cohort::server::CohortServer::Start(std::move(store), *options);
  if (!server.ok()) return Fail(server.status());
  LogServing(**server, *options, opened->where, keys, revision);
  return ServeUntilStopped(std::move(*server), stop_signals);
}

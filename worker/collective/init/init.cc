#include "worker/collective/init/init.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/file_store.h"
#include "client/membership_client.h"
#include "client/prefix_store.h"
#include "client/remote_store.h"
#include "client/tcpstore_client.h"
#include "worker/collective/init/flight_dumper.h"

namespace cohort {
namespace {

constexpr absl::string_view kDefaultPrefix = "cohort";

// The store to bootstrap through, and where this job's keys go in it.
struct Rendezvous {
  std::shared_ptr<Store> store;
  std::string prefix;
  int rank = -1;
  int world_size = -1;
};

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

absl::StatusOr<int> EnvInt(const char* name) {
  const std::string text = Env(name);
  int value = 0;
  if (text.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "env:// needs ", name, " in the environment (cohortrun sets it)"));
  }
  if (!absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "='", text, "' is not an integer"));
  }
  return value;
}

absl::StatusOr<std::shared_ptr<Store>> Connect(const std::string& address,
                                               absl::Duration timeout) {
  ConnectionOptions options;
  options.address = address;
  options.connect_timeout = timeout;
  absl::StatusOr<std::unique_ptr<RemoteStore>> store =
      RemoteStore::Connect(options);
  if (!store.ok()) return store.status();
  return std::shared_ptr<Store>(std::move(*store));
}

// tcpstore://HOST:PORT[/P][?dialect=probe|1.13|2.1]: a PyTorch TCPStore
// server, or cohortd's TCPStore port. Keys go under torch's "/" so that
// torch clients of the same server see them ("cohort/pg/...").
absl::StatusOr<std::shared_ptr<Store>> ConnectTcpStore(
    absl::string_view address, absl::string_view query,
    absl::Duration timeout) {
  TcpStoreClientOptions options;
  options.address = std::string(address);
  options.connect_timeout = timeout;
  options.key_prefix = "/";
  options.dialect = TcpStoreDialect::kProbe;
  if (query == "dialect=1.13") {
    options.dialect = TcpStoreDialect::kTorch113;
  } else if (query == "dialect=2.1") {
    options.dialect = TcpStoreDialect::kTorch21;
  } else if (!query.empty() && query != "dialect=probe") {
    return absl::InvalidArgumentError(absl::StrCat(
        "tcpstore://: unknown query '", query,
        "': use ?dialect=probe (the default), ?dialect=1.13 or ?dialect=2.1"));
  }
  absl::StatusOr<std::unique_ptr<TcpStoreClient>> store =
      TcpStoreClient::Connect(options);
  if (!store.ok()) return store.status();
  return std::shared_ptr<Store>(std::move(*store));
}

absl::StatusOr<Rendezvous> FromEnv(int rank, int world_size,
                                   absl::Duration timeout) {
  Rendezvous r;
  if (rank < 0) {
    absl::StatusOr<int> env_rank = EnvInt("RANK");
    if (!env_rank.ok()) return env_rank.status();
    rank = *env_rank;
  }
  if (world_size < 0) {
    absl::StatusOr<int> env_size = EnvInt("WORLD_SIZE");
    if (!env_size.ok()) return env_size.status();
    world_size = *env_size;
  }
  std::string address = Env("COHORT_ADDR");
  if (address.empty()) {
    const std::string host = Env("MASTER_ADDR"), port = Env("MASTER_PORT");
    if (host.empty() || port.empty()) {
      return absl::InvalidArgumentError(
          "env:// needs COHORT_ADDR, or MASTER_ADDR and MASTER_PORT, in the "
          "environment (cohortrun sets them)");
    }
    address = absl::StrCat(host, ":", port);
  }
  absl::StatusOr<std::shared_ptr<Store>> store = Connect(address, timeout);
  if (!store.ok()) return store.status();
  r.store = std::move(*store);
  r.prefix = Env("COHORT_STORE_PREFIX");
  if (r.prefix.empty()) r.prefix = std::string(kDefaultPrefix);
  r.rank = rank;
  r.world_size = world_size;
  return r;
}

absl::StatusOr<Rendezvous> FromUrl(absl::string_view init_method, int rank,
                                   int world_size, absl::Duration timeout) {
  if (rank < 0 || world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(init_method,
                     ": give rank and world_size (only env:// reads them from "
                     "the environment)"));
  }
  Rendezvous r;
  r.rank = rank;
  r.world_size = world_size;
  absl::string_view rest = init_method;
  if (absl::ConsumePrefix(&rest, "file://")) {
    if (rest.empty() || rest[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("file:// needs an absolute path (file:///path), got '",
                       init_method, "'"));
    }
    absl::StatusOr<std::unique_ptr<FileStore>> store =
        FileStore::Open(std::string(rest), world_size);
    if (!store.ok()) return store.status();
    r.store = std::shared_ptr<Store>(std::move(*store));
    r.prefix = std::string(kDefaultPrefix);
    return r;
  }
  const bool tcpstore = absl::ConsumePrefix(&rest, "tcpstore://");
  if (!tcpstore && !absl::ConsumePrefix(&rest, "cohort://") &&
      !absl::ConsumePrefix(&rest, "tcp://")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown init_method '", init_method,
        "': use env://, cohort://HOST:PORT[/prefix], tcp://HOST:PORT, "
        "tcpstore://HOST:PORT[/prefix][?dialect=1.13|2.1] or file:///path"));
  }
  absl::string_view query;
  if (const size_t q = rest.find('?'); tcpstore && q != rest.npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  const size_t slash = rest.find('/');
  const std::string address(rest.substr(0, slash));
  r.prefix = slash == absl::string_view::npos || slash + 1 == rest.size()
                 ? std::string(kDefaultPrefix)
                 : std::string(rest.substr(slash + 1));
  absl::StatusOr<std::shared_ptr<Store>> store =
      tcpstore ? ConnectTcpStore(address, query, timeout)
               : Connect(address, timeout);
  if (!store.ok()) return store.status();
  r.store = std::move(*store);
  return r;
}

}  // namespace

std::function<void(const absl::Status&)> NodeErrorReporterFromEnv(int rank) {
  const std::string address = Env("COHORT_ADDR");
  const std::string group = Env("COHORT_MEMBER_GROUP");
  const std::string name = Env("COHORT_MEMBER_NAME");
  int64_t incarnation = 0;
  if (address.empty() || group.empty() || name.empty() ||
      !absl::SimpleAtoi(Env("COHORT_MEMBER_INCARNATION"), &incarnation)) {
    return nullptr;
  }
  auto reported = std::make_shared<std::atomic<bool>>(false);
  return [=](const absl::Status& error) {
    if (reported->exchange(true)) return;
    ConnectionOptions connection;  // Token and TLS from the environment.
    connection.address = address;
    connection.connect_timeout = absl::Seconds(10);
    absl::Status sent =
        ReportMemberError(connection, group, name, incarnation,
                          absl::StrCat("rank ", rank, ": ", error.ToString()));
    if (!sent.ok()) {
      std::fprintf(stderr,
                   "cohort: rank %d could not report its failure to the "
                   "membership of %s in group %s: %s\n",
                   rank, name.c_str(), group.c_str(), sent.ToString().c_str());
    }
  };
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> InitProcessGroup(
    absl::string_view backend, absl::string_view init_method, int rank,
    int world_size, const InitOptions& options) {
  if (absl::Status known = CheckBackend(backend); !known.ok()) return known;
  const absl::Duration timeout = options.group.timeout;
  absl::StatusOr<Rendezvous> r =
      init_method == "env://" ? FromEnv(rank, world_size, timeout)
                              : FromUrl(init_method, rank, world_size, timeout);
  if (!r.ok()) return r.status();
  if (r->world_size < 1 || r->rank < 0 || r->rank >= r->world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", r->rank, " is not in [0, world_size=", r->world_size, ")"));
  }
  auto store = std::make_shared<PrefixStore>(r->prefix, std::move(r->store));

  // A job may create its group more than once (after a failure, in the same
  // store): the n-th creation by every rank shares a generation, and each
  // generation bootstraps under keys of its own, never a dead one's.
  absl::StatusOr<int64_t> arrivals = store->Add("pg/created", 1);
  if (!arrivals.ok()) return arrivals.status();
  const int64_t generation = (*arrivals - 1) / r->world_size;

  // Everything above serves every backend; the factory creates the one
  // named.
  InitOptions created = options;
  created.gloo.store_prefix = absl::StrCat("pg/", generation);
  created.nccl.store_prefix = created.gloo.store_prefix;
  if (backend == "nccl" && created.nccl.error_reporter == nullptr) {
    created.nccl.error_reporter = NodeErrorReporterFromEnv(r->rank);
  }
  // Under cohortrun, every group's recent ops go to cohortd on trouble.
  FlightDumper* dumper = FlightDumper::FromEnv();
  if (dumper != nullptr) {
    auto caller = std::move(created.group.on_op_failure);
    created.group.on_op_failure = [dumper, caller](const absl::Status& s) {
      dumper->OnOpFailure(s);
      if (caller) caller(s);
    };
  }
  absl::StatusOr<std::unique_ptr<ProcessGroup>> group = CreateProcessGroup(
      backend, std::move(store), r->rank, r->world_size, created);
  if (group.ok() && dumper != nullptr && (*group)->flight_recorder()) {
    FlightGroupInfo info;
    info.backend = std::string(backend);
    info.rank = r->rank;
    info.world_size = r->world_size;
    dumper->Add((*group)->flight_recorder(), std::move(info));
  }
  return group;
}

}  // namespace cohort

// store_bench: cohortd's KV store under the loads of
// bench/baselines/torch_store_bench.py (--mode=ops) and
// torch_init_storm.py (--mode=init_storm), printed in the same fields so the
// two can be read side by side. It prints figures and asserts none.
//
// Every client is a thread with a RemoteStore of its own, hence a TCP
// connection of its own, as every TCPStore client has. Clients connect and
// prepare before a common start, so, as in the torch scripts, the clock
// covers only the operations. With --tcpstore=HOST:PORT the clients are
// TcpStoreClients instead, speaking PyTorch's TCPStore protocol to a torch
// server or to cohortd's --tcpstore_listen port.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/remote_store.h"
#include "client/tcpstore_client.h"
#include "server/cohort_server.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"

ABSL_FLAG(std::string, mode, "ops",
          "ops: set/get/add throughput and latency; init_storm: the store "
          "traffic of N ranks initialising a full mesh");
ABSL_FLAG(std::string, addr, "",
          "HOST:PORT of a running cohortd; empty starts one in this process");
ABSL_FLAG(std::string, tcpstore, "",
          "HOST:PORT of a TCPStore server (PyTorch's, or cohortd's "
          "--tcpstore_listen): run the clients as TcpStoreClients over it "
          "instead of RemoteStores over gRPC");
ABSL_FLAG(std::string, tcpstore_dialect, "2.1",
          "--tcpstore: 2.1 (PyTorch 2.1+, cohortd), 1.13 (PyTorch 1.13/2.0) "
          "or probe");
ABSL_FLAG(std::string, engine, "rocksdb",
          "engine of the in-process cohortd: rocksdb (in a fresh temporary "
          "folder) or memory");
ABSL_FLAG(int, clients, 1, "--mode=ops: client threads");
ABSL_FLAG(int, ops, 20000, "--mode=ops: operations per client and op kind");
ABSL_FLAG(int, value_bytes, 64, "--mode=ops: bytes per value");
ABSL_FLAG(int, ranks, 128, "--mode=init_storm: simulated ranks");
ABSL_FLAG(int, wait_keys, 131072, "--mode=big_wait: keys in the one Wait");
ABSL_FLAG(int, big_values, 8,
          "--mode=big_wait: 8 MiB values written first (enough to make "
          "RocksDB flush them to disk)");
ABSL_FLAG(absl::Duration, wait_timeout, absl::Seconds(2),
          "--mode=big_wait: timeout of the big Wait");
ABSL_FLAG(std::string, storm_gets, "multi",
          "--mode=init_storm: multi (one MultiGet of all peers per rank) or "
          "single (one Get per peer, as Gloo over TCPStore does)");

namespace cohort::bench {
namespace {

// The cohortd under test, and the key prefix that keeps this run's keys
// apart from earlier runs when the cohortd is shared (--addr).
class Target {
 public:
  static absl::StatusOr<std::unique_ptr<Target>> Open(
      const std::string& addr, const std::string& tcpstore,
      const std::string& engine_name) {
    std::unique_ptr<Target> target(new Target());
    if (!tcpstore.empty()) {
      const std::string dialect = absl::GetFlag(FLAGS_tcpstore_dialect);
      if (dialect == "1.13") {
        target->dialect_ = TcpStoreDialect::kTorch113;
      } else if (dialect == "probe") {
        target->dialect_ = TcpStoreDialect::kProbe;
      } else if (dialect != "2.1") {
        return absl::InvalidArgumentError(
            absl::StrCat("--tcpstore_dialect must be 2.1, 1.13 or probe, got '",
                         dialect, "'"));
      }
      target->tcpstore_ = true;
    }
    if (!addr.empty() || !tcpstore.empty()) {
      target->address_ = tcpstore.empty() ? addr : tcpstore;
      target->prefix_ =
          absl::StrCat("store_bench/", absl::ToUnixNanos(absl::Now()), "/");
      return target;
    }
    std::unique_ptr<store::KvEngine> engine;
    if (engine_name == "memory") {
      engine = store::NewMemoryEngine();
    } else if (engine_name == "rocksdb") {
      std::string dir =
          (std::filesystem::temp_directory_path() / "store_bench.XXXXXX")
              .string();
      if (mkdtemp(dir.data()) == nullptr) {
        return absl::InternalError(
            absl::StrCat("cannot create a temporary folder like ", dir));
      }
      target->data_dir_ = dir;
      absl::StatusOr<std::unique_ptr<store::KvEngine>> opened =
          store::OpenRocksDbEngine({.path = dir, .sync_writes = false});
      if (!opened.ok()) return opened.status();
      engine = std::move(*opened);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--engine must be rocksdb or memory, got '", engine_name, "'"));
    }
    server::ServerOptions options;
    options.listen = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<server::CohortServer>> server =
        server::CohortServer::Start(
            std::make_unique<store::KvStore>(std::move(engine)), options);
    if (!server.ok()) return server.status();
    target->server_ = std::move(*server);
    target->address_ = absl::StrCat("127.0.0.1:", target->server_->port());
    return target;
  }

  ~Target() {
    server_.reset();
    if (!data_dir_.empty()) {
      std::error_code ignored;
      std::filesystem::remove_all(data_dir_, ignored);
    }
  }

  const std::string& address() const { return address_; }
  const std::string& prefix() const { return prefix_; }
  // The first word of each output line.
  const char* label() const { return tcpstore_ ? "tcpstore" : "cohort"; }

  // A client with a connection of its own, already connected: the first
  // call opens the connection, which TCPStore's constructor also does
  // before the torch scripts start their clocks.
  absl::StatusOr<std::unique_ptr<Store>> Connect() const {
    if (tcpstore_) {
      TcpStoreClientOptions options;
      options.address = address_;
      options.dialect = dialect_;
      absl::StatusOr<std::unique_ptr<TcpStoreClient>> client =
          TcpStoreClient::Connect(options);
      if (!client.ok()) return client.status();
      return std::unique_ptr<Store>(std::move(*client));
    }
    RemoteStoreOptions options;
    options.address = address_;
    absl::StatusOr<std::unique_ptr<RemoteStore>> client =
        RemoteStore::Connect(options);
    if (!client.ok()) return client.status();
    if (absl::StatusOr<int64_t> keys = (*client)->NumKeys(); !keys.ok()) {
      return keys.status();
    }
    return std::unique_ptr<Store>(std::move(*client));
  }

 private:
  Target() = default;

  bool tcpstore_ = false;
  TcpStoreDialect dialect_ = TcpStoreDialect::kTorch21;

  std::unique_ptr<server::CohortServer> server_;
  std::string data_dir_;
  std::string address_;
  std::string prefix_;
};

// `n` stores, each with its own connection, already connected.
absl::StatusOr<std::vector<std::unique_ptr<Store>>> ConnectClients(
    const Target& target, int n) {
  std::vector<std::unique_ptr<Store>> clients;
  clients.reserve(n);
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<std::unique_ptr<Store>> client = target.Connect();
    if (!client.ok()) return client.status();
    clients.push_back(std::move(*client));
  }
  return clients;
}

// Runs `prepare(i)` then `body(i)` on `n` threads; no body starts before
// every prepare has returned. Returns the wall time from that common start
// to the end of the last body, or the first error of any thread.
absl::StatusOr<absl::Duration> RunTogether(
    int n, const std::function<absl::Status(int)>& prepare,
    const std::function<absl::Status(int)>& body) {
  std::vector<absl::Status> errors(n);
  absl::BlockingCounter prepared(n);
  absl::Notification start;
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      errors[i] = prepare(i);
      prepared.DecrementCount();
      start.WaitForNotification();
      if (errors[i].ok()) errors[i] = body(i);
    });
  }
  prepared.Wait();
  const absl::Time t0 = absl::Now();
  start.Notify();
  for (std::thread& t : threads) t.join();
  const absl::Duration wall = absl::Now() - t0;
  for (const absl::Status& e : errors) {
    if (!e.ok()) return e;
  }
  return wall;
}

// The value at quantile `q` of `samples` (reordered in place).
absl::Duration Quantile(std::vector<absl::Duration>& samples, double q) {
  if (samples.empty()) return absl::ZeroDuration();
  size_t rank = static_cast<size_t>(std::ceil(q * samples.size()));
  rank = std::clamp<size_t>(rank, 1, samples.size()) - 1;
  std::nth_element(samples.begin(), samples.begin() + rank, samples.end());
  return samples[rank];
}

enum class Op { kSet, kGet, kAdd };

const char* OpName(Op op) {
  switch (op) {
    case Op::kSet:
      return "set";
    case Op::kGet:
      return "get";
    case Op::kAdd:
      return "add";
  }
  return "?";
}

// One op kind of torch_store_bench.py: `n` ops per client, each timed. Gets
// read keys their client wrote beforehand; adds all hit one counter.
absl::Status BenchOp(Op op, const Target& target,
                     std::vector<std::unique_ptr<Store>>& clients, int n,
                     const std::string& value) {
  const int num_clients = static_cast<int>(clients.size());
  auto key = [&](int client, int i) {
    return absl::StrCat(target.prefix(), "k", client, "_", i);
  };
  const std::string counter = absl::StrCat(target.prefix(), "counter");
  std::vector<std::vector<absl::Duration>> latencies(num_clients);

  auto prepare = [&](int c) -> absl::Status {
    latencies[c].reserve(n);
    if (op != Op::kGet) return absl::OkStatus();
    for (int i = 0; i < n; ++i) {
      if (absl::Status s = clients[c]->Set(key(c, i), value); !s.ok()) return s;
    }
    return absl::OkStatus();
  };
  auto body = [&](int c) -> absl::Status {
    Store& store = *clients[c];
    for (int i = 0; i < n; ++i) {
      absl::Status status;
      const absl::Time t0 = absl::Now();
      switch (op) {
        case Op::kSet:
          status = store.Set(key(c, i), value);
          break;
        case Op::kGet:
          status = store.Get(key(c, i)).status();
          break;
        case Op::kAdd:
          status = store.Add(counter, 1).status();
          break;
      }
      latencies[c].push_back(absl::Now() - t0);
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  };
  absl::StatusOr<absl::Duration> wall = RunTogether(num_clients, prepare, body);
  if (!wall.ok()) return wall.status();

  std::vector<absl::Duration> all;
  all.reserve(static_cast<size_t>(num_clients) * n);
  absl::Duration sum;
  for (const std::vector<absl::Duration>& l : latencies) {
    for (absl::Duration d : l) sum += d;
    all.insert(all.end(), l.begin(), l.end());
  }
  const int64_t total = static_cast<int64_t>(num_clients) * n;
  const double wall_s = absl::ToDoubleSeconds(*wall);
  const double p50_us = absl::ToDoubleMicroseconds(Quantile(all, 0.5));
  absl::PrintF(
      "%s op=%s clients=%d value=%dB ops=%d wall=%.3fs ops/s=%.0f "
      "mean_latency_us=%.1f p50_latency_us=%.1f p99_latency_us=%.1f\n",
      target.label(), OpName(op), num_clients, value.size(), total, wall_s,
      total / wall_s, absl::ToDoubleMicroseconds(sum) / total, p50_us,
      absl::ToDoubleMicroseconds(Quantile(all, 0.99)));
  std::fflush(stdout);
  return absl::OkStatus();
}

absl::Status RunOps(const Target& target) {
  const int clients = absl::GetFlag(FLAGS_clients);
  const int ops = absl::GetFlag(FLAGS_ops);
  const int value_bytes = absl::GetFlag(FLAGS_value_bytes);
  if (clients < 1 || ops < 1 || value_bytes < 0) {
    return absl::InvalidArgumentError(
        "--clients and --ops must be >= 1, --value_bytes >= 0");
  }
  absl::StatusOr<std::vector<std::unique_ptr<Store>>> stores =
      ConnectClients(target, clients);
  if (!stores.ok()) return stores.status();
  const std::string value(value_bytes, 'x');
  for (Op op : {Op::kSet, Op::kGet, Op::kAdd}) {
    if (absl::Status s = BenchOp(op, target, *stores, ops, value); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// torch_init_storm.py: each rank announces itself, waits for every peer's
// address and reads them all; O(N^2) key reads in all.
absl::Status RunInitStorm(const Target& target) {
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const std::string gets = absl::GetFlag(FLAGS_storm_gets);
  if (ranks < 1) return absl::InvalidArgumentError("--ranks must be >= 1");
  if (gets != "multi" && gets != "single") {
    return absl::InvalidArgumentError(
        absl::StrCat("--storm_gets must be multi or single, got '", gets, "'"));
  }
  absl::StatusOr<std::vector<std::unique_ptr<Store>>> stores =
      ConnectClients(target, ranks);
  if (!stores.ok()) return stores.status();

  const std::string arrived = absl::StrCat(target.prefix(), "arrived");
  std::vector<std::string> peers;
  peers.reserve(ranks);
  for (int r = 0; r < ranks; ++r) {
    peers.push_back(absl::StrCat(target.prefix(), "addr/", r));
  }
  const std::string address(64, 'a');

  auto rank = [&](int r) -> absl::Status {
    Store& store = *(*stores)[r];
    if (absl::Status s = store.Add(arrived, 1).status(); !s.ok()) return s;
    if (absl::Status s = store.Set(peers[r], address); !s.ok()) return s;
    // The same Wait as the torch script, so only how peers are read differs.
    if (absl::Status s = store.Wait(peers); !s.ok()) return s;
    if (gets == "multi") {
      absl::StatusOr<std::vector<std::string>> values = store.MultiGet(peers);
      if (!values.ok()) return values.status();
      if (values->size() != peers.size()) {
        return absl::InternalError(absl::StrCat("MultiGet returned ",
                                                values->size(), " values for ",
                                                peers.size(), " keys"));
      }
      return absl::OkStatus();
    }
    for (const std::string& peer : peers) {
      if (absl::Status s = store.Get(peer).status(); !s.ok()) return s;
    }
    return absl::OkStatus();
  };
  absl::StatusOr<absl::Duration> wall = RunTogether(
      ranks, [](int) { return absl::OkStatus(); }, rank);
  if (!wall.ok()) return wall.status();
  absl::PrintF("%s init-storm ranks=%d gets=%d wall_s=%.3f mode=%s\n",
               target.label(), ranks, static_cast<int64_t>(ranks) * ranks,
               absl::ToDoubleSeconds(*wall), gets);
  return absl::OkStatus();
}

// `clients` threads each Set in a loop, timing every call, until `stop`.
class SetLoad {
 public:
  SetLoad(const Target& target, std::vector<std::unique_ptr<Store>>& clients)
      : latencies_(clients.size()) {
    for (size_t c = 0; c < clients.size(); ++c) {
      threads_.emplace_back([&, c] {
        const std::string key = absl::StrCat(target.prefix(), "load/", c);
        while (!stop_) {
          const absl::Time t0 = absl::Now();
          absl::Status s = clients[c]->Set(key, "x");
          latencies_[c].push_back(absl::Now() - t0);
          if (!s.ok()) ++errors_;
        }
      });
    }
  }

  // Stops the load; prints what the sets saw.
  void StopAndPrint(absl::string_view phase) {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
    std::vector<absl::Duration> all;
    for (auto& l : latencies_) all.insert(all.end(), l.begin(), l.end());
    const size_t n = all.size();
    absl::PrintF(
        "cohort big-wait %s: concurrent sets=%d errors=%d p50_ms=%.2f "
        "p99_ms=%.2f max_ms=%.2f\n",
        phase, n, errors_.load(),
        absl::ToDoubleMilliseconds(Quantile(all, 0.5)),
        absl::ToDoubleMilliseconds(Quantile(all, 0.99)),
        absl::ToDoubleMilliseconds(Quantile(all, 1.0)));
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> errors_{0};
  std::vector<std::vector<absl::Duration>> latencies_;
  std::vector<std::thread> threads_;
};

// issue 9's large wait: a store holding 8 MiB values (flushed to disk), one
// Wait on --wait_keys missing keys, and Sets from --clients threads all the
// while. First the wait times out; then it waits again while the keys are
// written, and completes.
absl::Status RunBigWait(const Target& target) {
  const int n = absl::GetFlag(FLAGS_wait_keys);
  const absl::Duration timeout = absl::GetFlag(FLAGS_wait_timeout);
  absl::StatusOr<std::vector<std::unique_ptr<Store>>> stores =
      ConnectClients(target, absl::GetFlag(FLAGS_clients) + 1);
  if (!stores.ok()) return stores.status();
  Store& waiter = *stores->back();
  std::vector<std::unique_ptr<Store>> loaders;
  for (size_t i = 0; i + 1 < stores->size(); ++i) {
    loaders.push_back(std::move((*stores)[i]));
  }
  const std::string big(8 << 20, 'v');
  for (int i = 0; i < absl::GetFlag(FLAGS_big_values); ++i) {
    if (absl::Status s =
            waiter.Set(absl::StrCat(target.prefix(), "big/", i), big);
        !s.ok()) {
      return s;
    }
  }
  std::vector<std::string> keys;
  keys.reserve(n);
  for (int i = 0; i < n; ++i) {
    keys.push_back(absl::StrCat(target.prefix(), "wait/", i));
  }

  {
    SetLoad load(target, loaders);
    const absl::Time t0 = absl::Now();
    absl::Status s = waiter.Wait(keys, timeout);
    const absl::Duration took = absl::Now() - t0;
    load.StopAndPrint("timeout");
    absl::PrintF(
        "cohort big-wait timeout: keys=%d timeout_s=%.1f took_s=%.3f "
        "late_ms=%.1f status=%s\n",
        n, absl::ToDoubleSeconds(timeout), absl::ToDoubleSeconds(took),
        absl::ToDoubleMilliseconds(took - timeout),
        absl::StatusCodeToString(s.code()));
  }
  {
    SetLoad load(target, loaders);
    absl::Status waited;
    absl::Time done_at;
    std::thread t([&] {
      waited = waiter.Wait(keys, absl::Seconds(120));
      done_at = absl::Now();
    });
    constexpr int kBatch = 4096;
    const absl::Time t0 = absl::Now();
    absl::Time last_set;
    for (int i = 0; i < n; i += kBatch) {
      const int end = std::min(n, i + kBatch);
      std::vector<std::string> batch(keys.begin() + i, keys.begin() + end);
      std::vector<std::string> values(batch.size(), "1");
      if (absl::Status s = loaders.front()->MultiSet(batch, values); !s.ok()) {
        t.join();
        return s;
      }
      last_set = absl::Now();
    }
    t.join();
    load.StopAndPrint("complete");
    absl::PrintF(
        "cohort big-wait complete: keys=%d set_all_s=%.3f "
        "completed_after_last_set_ms=%.1f status=%s\n",
        n, absl::ToDoubleSeconds(last_set - t0),
        absl::ToDoubleMilliseconds(done_at - last_set),
        absl::StatusCodeToString(waited.code()));
  }
  return absl::OkStatus();
}

absl::Status Run() {
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "ops" && mode != "init_storm" && mode != "big_wait") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--mode must be ops, init_storm or big_wait, got '", mode, "'"));
  }
  absl::StatusOr<std::unique_ptr<Target>> target =
      Target::Open(absl::GetFlag(FLAGS_addr), absl::GetFlag(FLAGS_tcpstore),
                   absl::GetFlag(FLAGS_engine));
  if (!target.ok()) return target.status();
  if (mode == "big_wait") return RunBigWait(**target);
  return mode == "ops" ? RunOps(**target) : RunInitStorm(**target);
}

}  // namespace
}  // namespace cohort::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "store_bench --mode=ops --clients=N --ops=M [--value_bytes=B]\n"
      "store_bench --mode=init_storm --ranks=N [--storm_gets=multi|single]\n"
      "store_bench --mode=big_wait [--wait_keys=131072 --clients=4]\n"
      "Benchmarks cohortd's KV store (in-process unless --addr=HOST:PORT),\n"
      "or any TCPStore server through TcpStoreClient (--tcpstore=HOST:PORT\n"
      "[--tcpstore_dialect=2.1|1.13|probe]).");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = cohort::bench::Run(); !s.ok()) {
    std::fprintf(stderr, "store_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

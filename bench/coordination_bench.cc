// coordination_bench: one cohortd taking N nodes through a rendezvous
// round, an address exchange, a group join and a barrier: the standing
// scale benchmark (bench/coordination_bench.md has the figures at 10K, 30K
// and 100K).
//
// The nodes are asynchronous gRPC calls from this one process (spread over
// --channels connections), so N can be 100,000 on a small machine; with
// the default in-process cohortd, the figures are cohortd's and the nodes'
// together. For each phase it prints wall time, CPU seconds (user + sys,
// the whole process) and the bytes the nodes sent and received (message
// bytes, as serialized); then peak RSS. Asserts nothing.
//
//   bazel build -c opt //bench:coordination_bench
//   bazel-bin/bench/coordination_bench --nodes=100000 --fetch_peers=range
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "cohort/v1/coordination.grpc.pb.h"
#include "cohort/v1/store.grpc.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "server/cohort_server.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"

ABSL_FLAG(int, nodes, 1000, "nodes joining the round, members at the barrier");
ABSL_FLAG(int, channels, 32, "client connections the nodes are spread over");
ABSL_FLAG(std::string, addr, "",
          "cohortd HOST:PORT; empty starts one in this process");
ABSL_FLAG(std::string, engine, "rocksdb", "engine of the in-process cohortd");
ABSL_FLAG(std::string, fetch_peers, "range",
          "after the round, how each node learns its peers' addresses: "
          "none; range (GetParticipants: its ring neighbours and node rank "
          "0); full (ListParticipants, every page: all N, as "
          "RendezvousClient::Join does); store (the whole run record "
          "through the Store service, as clients before ListParticipants "
          "did). true means store, false none, as this flag once was");
ABSL_FLAG(bool, mutex_deadlock_detection, false,
          "keep absl::Mutex's deadlock detection on. Debian's libabsl is "
          "built without NDEBUG, so it is on unless turned off, and it "
          "keeps every mutex ever locked in a graph whose lookups slow "
          "down with the number of live mutexes (several per call in "
          "flight). Off here; cohortd's main has it on until it calls "
          "absl::SetMutexDeadlockDetectionMode(kIgnore) too");
ABSL_FLAG(int, client_queues, 8,
          "completion queues (one thread each) the nodes' calls are spread "
          "over");
ABSL_FLAG(int, fetch_inflight, 512,
          "full and store: the most nodes reading the list at once. This "
          "bounds the simulated nodes' receive buffers in this one process "
          "(a real node holds its own page), not cohortd's memory; 0: all");

namespace {

using cohort::v1::Membership;
using cohort::v1::Rendezvous;

// Counts completions of N asynchronous calls, the first error and the
// bytes the calls sent and received.
class Completion {
 public:
  explicit Completion(int n) : remaining_(n) {}

  void Done(const grpc::Status& status, size_t sent, size_t received) {
    sent_ += sent;
    received_ += received;
    absl::MutexLock lock(&mu_);
    if (!status.ok() && error_.ok()) {
      error_ = grpc::Status(status.error_code(), status.error_message());
    }
    --remaining_;
  }

  // Waits for all; returns the first error.
  grpc::Status Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* remaining) { return *remaining == 0; }, &remaining_));
    return error_;
  }

  // Counts the bytes of a call that completes nothing (a page before the
  // last).
  void Count(size_t sent, size_t received) {
    sent_ += sent;
    received_ += received;
  }

  uint64_t sent() const { return sent_; }
  uint64_t received() const { return received_; }

 private:
  std::atomic<uint64_t> sent_{0}, received_{0};
  absl::Mutex mu_;
  int remaining_ ABSL_GUARDED_BY(mu_);
  grpc::Status error_ ABSL_GUARDED_BY(mu_);
};

// The nodes' calls run on completion queues of their own, each drained by
// a thread, rather than through gRPC's callback API: that API puts every
// call of the process on one shared queue, and Debian's libgrpc, built
// without NDEBUG, scans a queue's outstanding tags on every completion.
// The nodes' calls would then slow cohortd's (in this same process) by the
// number of nodes in flight; real nodes run elsewhere.
class Tag {
 public:
  virtual ~Tag() = default;
  virtual void Done() = 0;
};

class Queues {
 public:
  explicit Queues(int n) {
    for (int i = 0; i < n; ++i) {
      queues_.push_back(std::make_unique<grpc::CompletionQueue>());
      threads_.emplace_back([cq = queues_.back().get()] {
        void* tag = nullptr;
        bool ok = false;
        while (cq->Next(&tag, &ok)) static_cast<Tag*>(tag)->Done();
      });
    }
  }
  ~Queues() {
    for (auto& cq : queues_) cq->Shutdown();
    for (auto& t : threads_) t.join();
  }
  grpc::CompletionQueue* operator[](size_t i) {
    return queues_[i % queues_.size()].get();
  }

 private:
  std::vector<std::unique_ptr<grpc::CompletionQueue>> queues_;
  std::vector<std::thread> threads_;
};

// One unary call of a node; `done` runs on a queue's thread when it ends.
template <typename Request, typename Response>
struct Call final : Tag {
  grpc::ClientContext context;
  Request request;
  Response response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> reader;
  std::function<void(Call&)> done;

  // `prepare(&context, request, cq)` is the stub's PrepareAsync method.
  template <typename Prepare>
  void Start(Prepare prepare, grpc::CompletionQueue* cq,
             std::function<void(Call&)> on_done) {
    done = std::move(on_done);
    reader = prepare(&context, request, cq);
    reader->StartCall();
    reader->Finish(&response, &status, this);
  }
  void Done() override { done(*this); }
};

double CpuSeconds() {
  rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

double PeakRssMb() {
  rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

double RssMb() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (sysconf(_SC_PAGESIZE) / 1048576.0);
}

// One phase's figures, printed as one line.
class Phase {
 public:
  Phase(std::string name, int n)
      : name_(std::move(name)),
        n_(n),
        start_(absl::Now()),
        cpu_start_(CpuSeconds()) {}

  absl::Duration Report(const Completion& calls, uint64_t num_calls) const {
    const absl::Duration wall = absl::Now() - start_;
    const double cpu = CpuSeconds() - cpu_start_;
    std::printf(
        "phase=%-10s nodes=%d wall_s=%.3f cpu_s=%.2f calls=%llu "
        "sent_bytes=%llu recv_bytes=%llu cpu_us_per_node=%.1f "
        "recv_bytes_per_node=%.0f rss_mb=%.0f peak_rss_mb=%.0f\n",
        name_.c_str(), n_, absl::ToDoubleSeconds(wall), cpu,
        static_cast<unsigned long long>(num_calls),
        static_cast<unsigned long long>(calls.sent()),
        static_cast<unsigned long long>(calls.received()), cpu * 1e6 / n_,
        static_cast<double>(calls.received()) / n_, RssMb(), PeakRssMb());
    std::fflush(stdout);
    return wall;
  }

 private:
  const std::string name_;
  const int n_;
  const absl::Time start_;
  const double cpu_start_;
};

int Fail(const std::string& what, const grpc::Status& status) {
  std::fprintf(stderr, "coordination_bench: %s failed: %s\n", what.c_str(),
               status.error_message().c_str());
  return 1;
}

// A ListParticipantsResponse read without building it: how many
// participants it holds and the next page's token. The simulated nodes
// share this process's CPU with cohortd; parsing 10^10 participants would
// measure protobuf, not cohortd.
struct PageSummary {
  int participants = 0;
  std::string next_page_token;
};

bool Summarize(grpc::ByteBuffer* page, PageSummary& summary) {
  grpc::ProtoBufferReader reader(page);
  google::protobuf::io::CodedInputStream in(&reader);
  in.SetTotalBytesLimit(1 << 30);
  while (uint32_t tag = in.ReadTag()) {
    const int field = tag >> 3;
    uint32_t length = 0;
    uint64_t ignored = 0;
    switch (tag & 7) {
      case 0:
        if (!in.ReadVarint64(&ignored)) return false;
        break;
      case 2:
        if (!in.ReadVarint32(&length)) return false;
        if (field == 2) {
          if (!in.ReadString(&summary.next_page_token, length)) return false;
        } else {
          if (field == 1) ++summary.participants;
          if (!in.Skip(length)) return false;
        }
        break;
      default:
        return false;
    }
  }
  return true;
}

// Every node reads the whole list a page at a time (ListParticipants,
// raw), at most `inflight` nodes at once.
class FullListReader {
 public:
  FullListReader(std::vector<std::shared_ptr<grpc::Channel>>& channels,
                 Queues& queues, std::string run_id, int n, int inflight)
      : queues_(queues),
        run_id_(std::move(run_id)),
        n_(n),
        inflight_(inflight),
        done_(n) {
    for (auto& channel : channels) {
      stubs_.push_back(std::make_unique<grpc::GenericStub>(channel));
    }
  }

  grpc::Status Run() {
    for (int i = 0; i < std::min(n_, inflight_); ++i) Next();
    return done_.Wait();
  }
  const Completion& calls() const { return done_; }
  uint64_t num_calls() const { return pages_; }
  bool all_complete() const { return short_lists_ == 0; }

 private:
  using Page = Call<grpc::ByteBuffer, grpc::ByteBuffer>;

  // Starts the next node's first page, if any node is left.
  void Next() {
    const int node = next_node_++;
    if (node < n_) Read(node, 0, "");
  }

  void Read(int node, int listed, const std::string& token) {
    cohort::v1::ListParticipantsRequest req;
    req.set_run_id(run_id_);
    req.set_page_size(10000);
    req.set_page_token(token);
    auto* page = new Page;
    bool own = false;
    grpc::SerializationTraits<cohort::v1::ListParticipantsRequest>::Serialize(
        req, &page->request, &own);
    ++pages_;
    page->Start(
        [stub = stubs_[node % stubs_.size()].get()](auto* ctx, auto& bytes,
                                                    auto* cq) {
          return stub->PrepareUnaryCall(
              ctx, "/cohort.v1.Rendezvous/ListParticipants", bytes, cq);
        },
        queues_[node],
        [this, node, listed](Page& p) {
          OnPage(std::unique_ptr<Page>(&p), node, listed);
        });
  }

  void OnPage(std::unique_ptr<Page> page, int node, int listed_before) {
    const grpc::Status s = page->status;
    const size_t sent = page->request.Length();
    const size_t received = page->response.Length();
    PageSummary summary;
    if (s.ok() && !Summarize(&page->response, summary)) {
      done_.Done(grpc::Status(grpc::StatusCode::DATA_LOSS, "bad page"), sent,
                 received);
      Next();
      return;
    }
    const int listed = listed_before + summary.participants;
    if (s.ok() && !summary.next_page_token.empty()) {
      done_.Count(sent, received);
      Read(node, listed, summary.next_page_token);
      return;
    }
    if (s.ok() && listed != n_) ++short_lists_;
    done_.Done(s, sent, received);
    Next();
  }

  Queues& queues_;
  const std::string run_id_;
  const int n_;
  const int inflight_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  std::atomic<int> next_node_{0};
  std::atomic<uint64_t> pages_{0};
  std::atomic<int> short_lists_{0};
  Completion done_;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_mutex_deadlock_detection)) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  const int n = absl::GetFlag(FLAGS_nodes);
  const int num_channels = std::max(1, absl::GetFlag(FLAGS_channels));
  std::string fetch = absl::GetFlag(FLAGS_fetch_peers);
  if (fetch == "true") fetch = "store";
  if (fetch == "false") fetch = "none";
  if (fetch != "none" && fetch != "range" && fetch != "full" &&
      fetch != "store") {
    std::fprintf(stderr,
                 "coordination_bench: --fetch_peers must be none, range, "
                 "full or store, not '%s'\n",
                 fetch.c_str());
    return 2;
  }
  const int inflight = absl::GetFlag(FLAGS_fetch_inflight) > 0
                           ? absl::GetFlag(FLAGS_fetch_inflight)
                           : n;
  const double cpu_at_start = CpuSeconds();

  std::unique_ptr<cohort::server::CohortServer> server;
  std::string address = absl::GetFlag(FLAGS_addr);
  std::filesystem::path dir;
  if (address.empty()) {
    std::unique_ptr<cohort::store::KvEngine> engine;
    if (absl::GetFlag(FLAGS_engine) == "memory") {
      engine = cohort::store::NewMemoryEngine();
    } else {
      dir = std::filesystem::temp_directory_path() /
            absl::StrCat("coordination_bench_", getpid());
      auto opened = cohort::store::OpenRocksDbEngine({.path = dir.string()});
      if (!opened.ok()) return 1;
      engine = std::move(*opened);
    }
    auto started = cohort::server::CohortServer::Start(
        std::make_unique<cohort::store::KvStore>(std::move(engine)),
        {.listen = "127.0.0.1:0"});
    if (!started.ok()) return 1;
    server = std::move(*started);
    address = absl::StrCat("127.0.0.1:", server->port());
  }

  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int c = 0; c < num_channels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    channels.push_back(grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), args));
    channels.back()->WaitForConnected(
        absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  }
  std::vector<std::unique_ptr<Rendezvous::Stub>> rdzv;
  std::vector<std::unique_ptr<Membership::Stub>> members;
  for (auto& channel : channels) {
    rdzv.push_back(Rendezvous::NewStub(channel));
    members.push_back(Membership::NewStub(channel));
  }
  const std::string run = absl::StrCat("bench-", getpid());
  Queues queues(absl::GetFlag(FLAGS_client_queues));

  // One rendezvous round: every node joins with min = max = N.
  using JoinCall = Call<cohort::v1::JoinRequest, cohort::v1::JoinResponse>;
  auto joins = std::make_unique<JoinCall[]>(n);
  Completion joined(n);
  Phase round_phase("rendezvous", n);
  for (int i = 0; i < n; ++i) {
    JoinCall& call = joins[i];
    call.request.set_run_id(run);
    call.request.set_node_id(absl::StrFormat("node-%06d", i));
    call.request.set_address(absl::StrFormat("10.%d.%d.%d:29400", i / 65536,
                                             i / 256 % 256, i % 256));
    call.request.set_local_world_size(8);
    call.request.set_min_nodes(n);
    call.request.set_max_nodes(n);
    call.request.set_join_timeout_ms(600000);
    call.Start(
        [stub = rdzv[i % num_channels].get()](auto* ctx, auto& req, auto* cq) {
          return stub->PrepareAsyncJoin(ctx, req, cq);
        },
        queues[i],
        [&joined](JoinCall& c) {
          joined.Done(c.status, c.request.ByteSizeLong(),
                      c.response.ByteSizeLong());
        });
  }
  if (grpc::Status s = joined.Wait(); !s.ok()) return Fail("rendezvous", s);
  const absl::Duration rendezvous = round_phase.Report(joined, n);
  {
    std::set<int> ranks;
    for (int i = 0; i < n; ++i) ranks.insert(joins[i].response.node_rank());
    if (static_cast<int>(ranks.size()) != n ||
        joins[0].response.world_size() != 8 * n) {
      std::fprintf(stderr, "coordination_bench: wrong ranks or world size\n");
      return 1;
    }
  }
  const int64_t round = joins[0].response.round();
  const std::string list_key = joins[0].response.participants_key();
  std::vector<int> node_rank(n);
  for (int i = 0; i < n; ++i) node_rank[i] = joins[i].response.node_rank();
  joins.reset();

  // The address exchange.
  absl::Duration fetch_wall;
  if (fetch == "range") {
    using GetCall = Call<cohort::v1::GetParticipantsRequest,
                         cohort::v1::GetParticipantsResponse>;
    auto gets = std::make_unique<GetCall[]>(n);
    Completion fetched(n);
    Phase phase("fetch-range", n);
    for (int i = 0; i < n; ++i) {
      GetCall& call = gets[i];
      call.request.set_run_id(run);
      call.request.set_round(round);
      const int me = node_rank[i];
      for (int r : {0, (me + n - 1) % n, (me + 1) % n}) {
        cohort::v1::NodeRankRange* range = call.request.add_ranges();
        range->set_start_node_rank(r);
        range->set_end_node_rank(r + 1);
      }
      call.Start(
          [stub = rdzv[i % num_channels].get()](auto* ctx, auto& req,
                                                auto* cq) {
            return stub->PrepareAsyncGetParticipants(ctx, req, cq);
          },
          queues[i],
          [&fetched, n](GetCall& c) {
            grpc::Status s = c.status;
            if (s.ok() && (c.response.participants_size() != 3 ||
                           c.response.num_nodes() != n)) {
              s = grpc::Status(grpc::StatusCode::DATA_LOSS, "wrong peers");
            }
            fetched.Done(s, c.request.ByteSizeLong(),
                         c.response.ByteSizeLong());
          });
    }
    if (grpc::Status s = fetched.Wait(); !s.ok()) return Fail("peer range", s);
    fetch_wall = phase.Report(fetched, n);
  } else if (fetch == "full") {
    FullListReader reader(channels, queues, run, n, inflight);
    Phase phase("fetch-full", n);
    if (grpc::Status s = reader.Run(); !s.ok()) return Fail("peer list", s);
    if (!reader.all_complete()) {
      std::fprintf(stderr, "coordination_bench: a node read a short list\n");
      return 1;
    }
    fetch_wall = phase.Report(reader.calls(), reader.num_calls());
  } else if (fetch == "store" && !list_key.empty()) {
    using GetCall = Call<cohort::v1::GetRequest, cohort::v1::GetResponse>;
    std::vector<std::unique_ptr<cohort::v1::Store::Stub>> store;
    for (auto& channel : channels) {
      store.push_back(cohort::v1::Store::NewStub(channel));
    }
    Completion fetched(n);
    std::atomic<int> next{0};
    std::function<void()> start_next = [&] {
      const int i = next++;
      if (i >= n) return;
      auto* call = new GetCall;
      call->request.set_key(list_key);
      call->Start([stub = store[i % num_channels].get()](
                      auto* ctx, auto& req,
                      auto* cq) { return stub->PrepareAsyncGet(ctx, req, cq); },
                  queues[i],
                  [&](GetCall& c) {
                    fetched.Done(c.status, c.request.ByteSizeLong(),
                                 c.response.ByteSizeLong());
                    delete &c;
                    start_next();
                  });
    };
    Phase phase("fetch-store", n);
    for (int i = 0; i < std::min(n, inflight); ++i) start_next();
    if (grpc::Status s = fetched.Wait(); !s.ok()) return Fail("peer list", s);
    fetch_wall = phase.Report(fetched, n);
  }

  // Membership: every node joins the group, then one barrier of all.
  using GroupCall =
      Call<cohort::v1::JoinGroupRequest, cohort::v1::JoinGroupResponse>;
  auto group_joins = std::make_unique<GroupCall[]>(n);
  Completion grouped(n);
  Phase group_phase("join-group", n);
  for (int i = 0; i < n; ++i) {
    GroupCall& call = group_joins[i];
    call.request.set_group(run);
    call.request.set_name(absl::StrFormat("node-%06d", i));
    call.request.set_rank(i);
    call.request.set_heartbeat_interval_ms(60000);
    call.Start(
        [stub = members[i % num_channels].get()](auto* ctx, auto& req,
                                                 auto* cq) {
          return stub->PrepareAsyncJoinGroup(ctx, req, cq);
        },
        queues[i],
        [&grouped](GroupCall& c) {
          grouped.Done(c.status, c.request.ByteSizeLong(),
                       c.response.ByteSizeLong());
        });
  }
  if (grpc::Status s = grouped.Wait(); !s.ok()) return Fail("join group", s);
  const absl::Duration join_group = group_phase.Report(grouped, n);
  std::vector<int64_t> incarnation(n);
  for (int i = 0; i < n; ++i) {
    incarnation[i] = group_joins[i].response.incarnation();
  }
  group_joins.reset();

  using BarrierCall =
      Call<cohort::v1::BarrierRequest, cohort::v1::BarrierResponse>;
  auto barriers = std::make_unique<BarrierCall[]>(n);
  Completion passed(n);
  Phase barrier_phase("barrier", n);
  for (int i = 0; i < n; ++i) {
    BarrierCall& call = barriers[i];
    call.request.set_group(run);
    call.request.set_barrier_id("step");
    call.request.set_name(absl::StrFormat("node-%06d", i));
    call.request.set_incarnation(incarnation[i]);
    call.request.set_timeout_ms(600000);
    call.Start(
        [stub = members[i % num_channels].get()](auto* ctx, auto& req,
                                                 auto* cq) {
          return stub->PrepareAsyncBarrier(ctx, req, cq);
        },
        queues[i],
        [&passed](BarrierCall& c) {
          passed.Done(c.status, c.request.ByteSizeLong(),
                      c.response.ByteSizeLong());
        });
  }
  if (grpc::Status s = passed.Wait(); !s.ok()) return Fail("barrier", s);
  const absl::Duration barrier = barrier_phase.Report(passed, n);

  const absl::Duration total = rendezvous + fetch_wall + join_group + barrier;
  std::printf(
      "total nodes=%d fetch_peers=%s wall_s=%.3f "
      "(rendezvous+join-group+barrier %.3f) cpu_s=%.2f peak_rss_mb=%.0f\n",
      n, fetch.c_str(), absl::ToDoubleSeconds(total),
      absl::ToDoubleSeconds(rendezvous + join_group + barrier),
      CpuSeconds() - cpu_at_start, PeakRssMb());
  std::fflush(stdout);

  if (server) server->Drain().IgnoreError();
  server.reset();
  if (!dir.empty()) std::filesystem::remove_all(dir);
  return 0;
}

// coordination_bench: how long N nodes take to complete one rendezvous
// round, and N members one barrier, against one cohortd.
//
// The nodes are asynchronous gRPC calls from this one process (spread over
// --channels connections), so N can be 10,000 on a small machine. Prints
// figures; asserts nothing.
//
//   bazel run -c opt //bench:coordination_bench -- --nodes=10000
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "cohort/v1/coordination.grpc.pb.h"
#include "cohort/v1/store.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "server/cohort_server.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"

ABSL_FLAG(int, nodes, 1000, "nodes joining the round, members at the barrier");
ABSL_FLAG(int, channels, 32, "client connections the nodes are spread over");
ABSL_FLAG(std::string, addr, "",
          "cohortd HOST:PORT; empty starts one in this process");
ABSL_FLAG(std::string, engine, "rocksdb", "engine of the in-process cohortd");
ABSL_FLAG(bool, fetch_peers, true,
          "after a round too large to carry the participant list inline, have "
          "every node read it from the store, as RendezvousClient::Join does");

namespace {

using cohort::v1::Membership;
using cohort::v1::Rendezvous;

// Counts completions of N asynchronous calls and the first error.
class Completion {
 public:
  explicit Completion(int n) : remaining_(n) {}

  void Done(const grpc::Status& status) {
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

 private:
  absl::Mutex mu_;
  int remaining_ ABSL_GUARDED_BY(mu_);
  grpc::Status error_ ABSL_GUARDED_BY(mu_);
};

template <typename Request, typename Response>
struct Call {
  grpc::ClientContext context;
  Request request;
  Response response;
};

int Fail(const std::string& what, const grpc::Status& status) {
  std::fprintf(stderr, "coordination_bench: %s failed: %s\n", what.c_str(),
               status.error_message().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_nodes);
  const int num_channels = std::max(1, absl::GetFlag(FLAGS_channels));

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

  // One rendezvous round: every node joins with min = max = N.
  using JoinCall = Call<cohort::v1::JoinRequest, cohort::v1::JoinResponse>;
  std::vector<JoinCall> joins(n);
  Completion joined(n);
  absl::Time start = absl::Now();
  for (int i = 0; i < n; ++i) {
    JoinCall& call = joins[i];
    call.request.set_run_id(run);
    call.request.set_node_id(absl::StrFormat("node-%06d", i));
    call.request.set_address(
        absl::StrFormat("10.0.%d.%d:29400", i / 256, i % 256));
    call.request.set_local_world_size(8);
    call.request.set_min_nodes(n);
    call.request.set_max_nodes(n);
    call.request.set_join_timeout_ms(120000);
    rdzv[i % num_channels]->async()->Join(
        &call.context, &call.request, &call.response,
        [&joined](grpc::Status s) { joined.Done(s); });
  }
  if (grpc::Status s = joined.Wait(); !s.ok()) return Fail("rendezvous", s);
  const absl::Duration rendezvous = absl::Now() - start;
  std::set<int> ranks;
  for (const JoinCall& call : joins) ranks.insert(call.response.node_rank());
  if (static_cast<int>(ranks.size()) != n ||
      joins[0].response.world_size() != 8 * n) {
    std::fprintf(stderr, "coordination_bench: wrong ranks or world size\n");
    return 1;
  }
  std::printf("cohort rendezvous nodes=%d wall_s=%.3f\n", n,
              absl::ToDoubleSeconds(rendezvous));

  const std::string& list_key = joins[0].response.participants_key();
  if (absl::GetFlag(FLAGS_fetch_peers) && !list_key.empty()) {
    using GetCall = Call<cohort::v1::GetRequest, cohort::v1::GetResponse>;
    std::vector<std::unique_ptr<cohort::v1::Store::Stub>> store;
    for (auto& channel : channels) {
      store.push_back(cohort::v1::Store::NewStub(channel));
    }
    std::vector<GetCall> gets(n);
    Completion fetched(n);
    const absl::Time fetch_start = absl::Now();
    for (int i = 0; i < n; ++i) {
      gets[i].request.set_key(list_key);
      store[i % num_channels]->async()->Get(
          &gets[i].context, &gets[i].request, &gets[i].response,
          [&fetched](grpc::Status s) { fetched.Done(s); });
    }
    if (grpc::Status s = fetched.Wait(); !s.ok()) return Fail("peer list", s);
    const absl::Duration fetch = absl::Now() - fetch_start;
    std::printf(
        "cohort rendezvous+peer-lists nodes=%d list_bytes=%zu wall_s=%.3f\n", n,
        gets[0].response.value().size(),
        absl::ToDoubleSeconds(rendezvous + fetch));
  }

  // Membership: every node joins the group, then one barrier of all.
  using GroupCall =
      Call<cohort::v1::JoinGroupRequest, cohort::v1::JoinGroupResponse>;
  std::vector<GroupCall> group_joins(n);
  Completion grouped(n);
  start = absl::Now();
  for (int i = 0; i < n; ++i) {
    GroupCall& call = group_joins[i];
    call.request.set_group(run);
    call.request.set_name(absl::StrFormat("node-%06d", i));
    call.request.set_rank(i);
    call.request.set_heartbeat_interval_ms(60000);
    members[i % num_channels]->async()->JoinGroup(
        &call.context, &call.request, &call.response,
        [&grouped](grpc::Status s) { grouped.Done(s); });
  }
  if (grpc::Status s = grouped.Wait(); !s.ok()) return Fail("join group", s);
  const absl::Duration join_group = absl::Now() - start;

  using BarrierCall =
      Call<cohort::v1::BarrierRequest, cohort::v1::BarrierResponse>;
  std::vector<BarrierCall> barriers(n);
  Completion passed(n);
  start = absl::Now();
  for (int i = 0; i < n; ++i) {
    BarrierCall& call = barriers[i];
    call.request.set_group(run);
    call.request.set_barrier_id("step");
    call.request.set_name(group_joins[i].request.name());
    call.request.set_incarnation(group_joins[i].response.incarnation());
    call.request.set_timeout_ms(120000);
    members[i % num_channels]->async()->Barrier(
        &call.context, &call.request, &call.response,
        [&passed](grpc::Status s) { passed.Done(s); });
  }
  if (grpc::Status s = passed.Wait(); !s.ok()) return Fail("barrier", s);
  const absl::Duration barrier = absl::Now() - start;
  std::printf("cohort join-group members=%d wall_s=%.3f\n", n,
              absl::ToDoubleSeconds(join_group));
  std::printf("cohort barrier members=%d wall_s=%.3f\n", n,
              absl::ToDoubleSeconds(barrier));
  std::printf("cohort rendezvous+barrier nodes=%d wall_s=%.3f\n", n,
              absl::ToDoubleSeconds(rendezvous + barrier));

  if (server) server->Drain().IgnoreError();
  server.reset();
  if (!dir.empty()) std::filesystem::remove_all(dir);
  return 0;
}

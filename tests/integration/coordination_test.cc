// Rendezvous and membership against cohortd as a real process, with
// members that are real processes where the test kills them.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/membership_client.h"
#include "client/rendezvous_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cohortd_process.h"

namespace cohort {
namespace {

using testing::CohortdProcess;
using ::testing::HasSubstr;

ConnectionOptions At(const std::string& address) {
  ConnectionOptions options;
  options.address = address;
  options.connect_timeout = absl::Seconds(10);
  return options;
}

RendezvousOptions Node(const std::string& id, int min, int max) {
  RendezvousOptions o;
  o.run_id = "job";
  o.node_id = id;
  o.address = id + ".local";
  o.local_world_size = 2;
  o.min_nodes = min;
  o.max_nodes = max;
  o.join_timeout = absl::Seconds(20);
  o.last_call_timeout = absl::Milliseconds(500);
  return o;
}

// Joins every node on a thread of its own (each with its own connection).
std::vector<absl::StatusOr<RendezvousResult>> JoinAll(
    const std::string& address, const std::vector<RendezvousOptions>& nodes) {
  std::vector<absl::StatusOr<RendezvousResult>> results(nodes.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < nodes.size(); ++i) {
    threads.emplace_back([&, i] {
      auto client = RendezvousClient::Connect(At(address));
      results[i] = client.ok() ? (*client)->Join(nodes[i]) : client.status();
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// A member in a child process (tests/testing/member_main).
struct MemberProcess {
  pid_t pid = -1;
  ~MemberProcess() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

MemberProcess StartMember(const std::string& address, const std::string& name,
                          int rank, int interval_ms) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  // Everything the child needs is built before fork: it only execs, since
  // allocating in the child of a threaded parent can deadlock.
  std::vector<std::string> args = {"tests/testing/member_main",
                                   "--addr=" + address,
                                   "--group=job",
                                   "--name=" + name,
                                   absl::StrCat("--rank=", rank),
                                   "--host=host-" + name,
                                   absl::StrCat("--interval_ms=", interval_ms)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  MemberProcess m;
  m.pid = fork();
  if (m.pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  char buf[64] = {};
  struct pollfd joined = {fds[0], POLLIN, 0};
  EXPECT_EQ(poll(&joined, 1, 30000), 1) << "member did not join in 30 s";
  EXPECT_GT(read(fds[0], buf, sizeof(buf) - 1), 0) << "member did not join";
  close(fds[0]);
  return m;
}

class CoordinationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    auto server = CohortdProcess::Start({"--data_dir=" + dir_.string()});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::make_unique<CohortdProcess>(std::move(*server));
  }

  std::filesystem::path dir_;
  std::unique_ptr<CohortdProcess> server_;
};

TEST_F(CoordinationTest, ThreeNodesGetDistinctRanksAndOneWorldSize) {
  // The round completes at max_nodes: a last call that outlasts the test
  // cannot end it with the first two, however late the third joins.
  std::vector<RendezvousOptions> nodes = {Node("n0", 2, 3), Node("n1", 2, 3),
                                          Node("n2", 2, 3)};
  for (RendezvousOptions& node : nodes) {
    node.join_timeout = absl::Minutes(10);
    node.last_call_timeout = absl::Minutes(10);
  }
  auto results = JoinAll(server_->address(), nodes);
  std::set<int> node_ranks, first_ranks;
  for (auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->num_nodes, 3);
    EXPECT_EQ(r->world_size, 6);
    EXPECT_EQ(r->peers.size(), 3u);
    EXPECT_EQ(r->store_prefix, results[0]->store_prefix);
    node_ranks.insert(r->node_rank);
    first_ranks.insert(r->first_global_rank);
  }
  EXPECT_EQ(node_ranks, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(first_ranks, (std::set<int>{0, 2, 4}));
}

TEST_F(CoordinationTest, TwoOfFourCompleteAfterLastCall) {
  const absl::Time start = absl::Now();
  auto results =
      JoinAll(server_->address(), {Node("n0", 2, 4), Node("n1", 2, 4)});
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(500));
  for (auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->num_nodes, 2);
    EXPECT_EQ(r->world_size, 4);
  }
}

TEST_F(CoordinationTest, JoinTimeoutSaysHowManyArrived) {
  RendezvousOptions node = Node("n0", 3, 3);
  node.join_timeout = absl::Milliseconds(300);
  auto results = JoinAll(server_->address(), {node});
  EXPECT_EQ(results[0].status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(results[0].status().message(),
              HasSubstr("1 of min_nodes=3 nodes arrived (n0)"));
}

TEST_F(CoordinationTest, LateJoinerWaitsThenGetsTheNextRound) {
  auto first =
      JoinAll(server_->address(), {Node("n0", 2, 2), Node("n1", 2, 2)});
  ASSERT_TRUE(first[0].ok() && first[1].ok());
  auto client = RendezvousClient::Connect(At(server_->address()));
  ASSERT_TRUE(client.ok());

  absl::StatusOr<RendezvousResult> late;
  std::thread joiner([&] {
    auto mine = RendezvousClient::Connect(At(server_->address()));
    late = (*mine)->Join(Node("n2", 2, 2));
  });
  absl::StatusOr<RunStatus> status;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (absl::Now() < give_up) {
    status = (*client)->GetRunStatus("job");
    if (status.ok() && status->num_waiting == 1) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->num_waiting, 1);
  EXPECT_EQ(status->phase, RunStatus::Phase::kComplete);
  // A node of round 0 re-joins (as cohortrun does when it sees waiters).
  auto again = JoinAll(server_->address(), {Node("n0", 2, 2)});
  joiner.join();
  ASSERT_TRUE(late.ok()) << late.status();
  ASSERT_TRUE(again[0].ok());
  EXPECT_EQ(late->round, first[0]->round + 1);
  EXPECT_EQ(late->num_nodes, 2);

  ASSERT_TRUE((*client)->CloseRun("job").ok());
  auto closed = JoinAll(server_->address(), {Node("n0", 2, 2)});
  EXPECT_EQ(closed[0].status().code(), absl::StatusCode::kFailedPrecondition);
}

// Over 256 nodes the join's reply leaves the participants out; each node
// reads them with ListParticipants, not from cohortd's stored record.
TEST_F(CoordinationTest, ALargeRoundsNodesReadTheirPeersThroughTheRpc) {
  constexpr int kNodes = 260;
  std::vector<RendezvousOptions> nodes;
  for (int i = 0; i < kNodes; ++i) {
    nodes.push_back(Node(absl::StrCat("n", 1000 + i), kNodes, kNodes));
  }
  auto results = JoinAll(server_->address(), nodes);
  for (int i = 0; i < kNodes; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    const RendezvousResult& r = *results[i];
    EXPECT_EQ(r.node_rank, i);
    ASSERT_EQ(r.peers.size(), static_cast<size_t>(kNodes));
    EXPECT_EQ(r.peers[i].node_id, nodes[i].node_id);
    EXPECT_EQ(r.peers.back().first_global_rank, 2 * (kNodes - 1));
  }
}

// A node of a large round that reads only the peers it talks to: its ring
// neighbours and the root, through GetParticipants.
TEST_F(CoordinationTest, ALargeRoundsNodesLookUpPeersByRank) {
  constexpr int kNodes = 260;
  std::vector<RendezvousOptions> nodes;
  for (int i = 0; i < kNodes; ++i) {
    nodes.push_back(Node(absl::StrCat("n", 1000 + i), kNodes, kNodes));
    nodes.back().list_peers = false;
  }
  auto results = JoinAll(server_->address(), nodes);
  auto client = RendezvousClient::Connect(At(server_->address()));
  ASSERT_TRUE(client.ok()) << client.status();
  for (int i : {0, 1, 17, kNodes - 1}) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    const RendezvousResult& r = *results[i];
    EXPECT_TRUE(r.peers.empty());
    const int prev = (i + kNodes - 1) % kNodes, next = (i + 1) % kNodes;
    auto peers = (*client)->GetPeers(
        "job", r.round, {{0, 1}, {prev, prev + 1}, {next, next + 1}});
    ASSERT_TRUE(peers.ok()) << peers.status();
    ASSERT_EQ(peers->size(), 3u);
    EXPECT_EQ((*peers)[0].node_id, "n1000");
    EXPECT_EQ((*peers)[1].node_rank, prev);
    EXPECT_EQ((*peers)[1].address, nodes[prev].address);
    EXPECT_EQ((*peers)[2].node_id, nodes[next].node_id);
    EXPECT_EQ((*peers)[2].first_global_rank, 2 * next);
  }
  auto outside = (*client)->GetPeers("job", 0, {{kNodes - 1, kNodes + 1}});
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(outside.status().message(), HasSubstr("[259, 261)"));
  auto stale = (*client)->GetPeers("job", 3, {{0, 1}});
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kAborted);
  auto status = (*client)->GetRunStatus("job");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->num_participants, kNodes);
}

// Collects member events.
struct Events {
  absl::Mutex mu;
  std::vector<std::pair<MemberEvent, absl::Time>> seen;
  void Add(const MemberEvent& e) {
    absl::MutexLock l(&mu);
    seen.emplace_back(e, absl::Now());
  }
  // Waits for an event of `type` about `name`; returns when it was seen.
  std::optional<std::pair<MemberEvent, absl::Time>> Await(
      MemberEvent::Type type, const std::string& name, absl::Duration limit) {
    absl::MutexLock l(&mu);
    std::optional<std::pair<MemberEvent, absl::Time>> found;
    auto match = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      for (auto& s : seen) {
        if (s.first.type == type && s.first.member.name == name) {
          found = s;
          return true;
        }
      }
      return false;
    };
    mu.AwaitWithTimeout(absl::Condition(&match), limit);
    return found;
  }
};

TEST_F(CoordinationTest, Kill9OfAMemberIsSeenAsFailedByItsMissedHeartbeats) {
  auto client = MembershipClient::Connect(At(server_->address()));
  ASSERT_TRUE(client.ok());
  Events events;
  auto watch =
      (*client)->Watch("job", [&](const MemberEvent& e) { events.Add(e); });
  ASSERT_TRUE(watch.ok());
  constexpr int kIntervalMs = 200;  // Lease: 3 x 200 ms.
  MemberProcess victim = StartMember(server_->address(), "b", 1, kIntervalMs);
  ASSERT_TRUE(events.Await(MemberEvent::Type::kJoined, "b", absl::Seconds(60)));

  kill(victim.pid, SIGKILL);
  // Lease expiry is what fails a member (nothing else does), and its
  // message says which lease: this member's 3 x 200 ms.
  auto failed =
      events.Await(MemberEvent::Type::kFailed, "b", absl::Seconds(60));
  ASSERT_TRUE(failed.has_value()) << "b was not declared failed (gave up "
                                     "after 60 s)";
  EXPECT_THAT(failed->first.message,
              HasSubstr("no heartbeat for 600ms (3 intervals of 200ms)"));
  auto live = (*client)->ListMembers("job");
  ASSERT_TRUE(live.ok());
  EXPECT_TRUE(live->empty());
}

TEST_F(CoordinationTest, BarrierWithADeadMemberFailsNamingIt) {
  auto client = MembershipClient::Connect(At(server_->address()));
  ASSERT_TRUE(client.ok());
  MemberOptions options;
  options.group = "job";
  options.name = "a";
  options.rank = 0;
  options.host = "host-a";
  options.heartbeat_interval = absl::Milliseconds(200);
  auto me = (*client)->JoinGroup(options);
  ASSERT_TRUE(me.ok());
  MemberProcess peer = StartMember(server_->address(), "b", 1, 200);
  kill(peer.pid, SIGKILL);
  absl::Status s = (*me)->Barrier("init", absl::Seconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1 (host-b)"));
}

TEST_F(CoordinationTest, BarrierTimeoutNamesWhoIsMissing) {
  auto client = MembershipClient::Connect(At(server_->address()));
  MemberOptions a{"job", "a", 0, "host-a", absl::Seconds(1), 3};
  auto me = (*client)->JoinGroup(a);
  // b's lease (3 x 10 min) outlasts the test: it is missing from the
  // barrier, never failed.
  MemberProcess peer = StartMember(server_->address(), "b", 2, 10 * 60 * 1000);
  absl::Status s = (*me)->Barrier("init", absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("1/2 arrived; missing: rank 2 (host-b)"));
}

TEST_F(CoordinationTest, ReportedErrorReachesEveryMember) {
  auto client = MembershipClient::Connect(At(server_->address()));
  Events seen_by_a, seen_by_b;
  auto watch_a =
      (*client)->Watch("job", [&](const MemberEvent& e) { seen_by_a.Add(e); });
  auto other = MembershipClient::Connect(At(server_->address()));
  auto watch_b =
      (*other)->Watch("job", [&](const MemberEvent& e) { seen_by_b.Add(e); });
  // Leases that outlast the test: the barrier can only end by the error.
  auto a =
      (*client)->JoinGroup({"job", "a", 0, "host-a", absl::Minutes(10), 3});
  auto b = (*other)->JoinGroup({"job", "b", 1, "host-b", absl::Minutes(10), 3});
  ASSERT_TRUE(a.ok() && b.ok());
  absl::Status barrier;
  absl::Notification returned;
  std::thread waiter([&] {
    barrier = (*a)->Barrier("step", absl::Minutes(10));
    returned.Notify();
  });
  // An error reported before a arrives aborts nothing, so b reports until
  // a's barrier returns (it cannot time out within the test).
  do {
    ASSERT_TRUE((*b)->ReportError("loss is NaN").ok());
  } while (!returned.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  waiter.join();
  EXPECT_EQ(barrier.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(barrier.message(), HasSubstr("loss is NaN"));
  for (Events* events : {&seen_by_a, &seen_by_b}) {
    auto e =
        events->Await(MemberEvent::Type::kErrorReported, "b", absl::Seconds(5));
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->first.message, "loss is NaN");
  }
}

TEST_F(CoordinationTest, MembersKeepTheirMembershipAcrossACohortdRestart) {
  const int port = server_->port();
  auto client = MembershipClient::Connect(At(server_->address()));
  // The restart (well under a second) fits in a lease several times over.
  const absl::Duration interval = absl::Seconds(1);
  const absl::Duration lease = 3 * interval;
  auto a = (*client)->JoinGroup({"job", "a", 0, "host-a", interval, 3});
  ASSERT_TRUE(a.ok());
  const int64_t incarnation = (*a)->incarnation();
  Events events;
  auto watch =
      (*client)->Watch("job", [&](const MemberEvent& e) { events.Add(e); });

  ASSERT_EQ(server_->Stop(SIGTERM), 0);
  auto restarted = CohortdProcess::Start({"--data_dir=" + dir_.string()}, port);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  server_ = std::make_unique<CohortdProcess>(std::move(*restarted));
  // The restarted cohortd gave the member one lease of grace from when it
  // loaded, before now. Past that (and a sweep) only heartbeats to the new
  // cohortd can have kept it.
  absl::SleepFor(lease + interval);
  auto live = (*client)->ListMembers("job");
  ASSERT_TRUE(live.ok()) << live.status();
  ASSERT_EQ(live->size(), 1u);
  EXPECT_EQ((*live)[0].incarnation, incarnation);
  EXPECT_TRUE((*a)->health().ok()) << (*a)->health();
  EXPECT_FALSE(
      events.Await(MemberEvent::Type::kFailed, "a", absl::Milliseconds(1)));
}

}  // namespace
}  // namespace cohort

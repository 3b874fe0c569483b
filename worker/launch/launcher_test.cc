#include "worker/launch/launcher.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// What the fake cohortd knows, shared by the fake clients and the test.
// This node is "node-a"; a two-node run adds "node-b", whose group
// incarnation in round R is 100 + R.
struct World {
  absl::Mutex mu;
  int nodes = 1;  // In every round.
  int rounds = 0;
  RunStatus run_status;        // Returned by GetRunStatus.
  int peer_group_rank = 1;     // node-b's rank in ListMembers; -1: absent.
  absl::Status start_barrier;  // What the first start barrier returns.
  absl::Notification* join_gate = nullptr;  // Join waits on it.
  absl::Status health;
  int64_t next_incarnation = 1;
  std::vector<std::string> barriers;
  std::vector<std::string> reported_errors;
  int leaves = 0;
  MemberEventCallback watcher;
  std::vector<std::string> log;

  void Emit(MemberEvent::Type type, const std::string& name,
            int64_t incarnation, const std::string& message = "") {
    MemberEventCallback callback;
    {
      absl::MutexLock lock(&mu);
      callback = watcher;
    }
    MemberEvent event;
    event.type = type;
    event.member.name = name;
    event.member.incarnation = incarnation;
    event.message = message;
    callback(event);
  }

  bool Logged(const std::string& text) {
    absl::MutexLock lock(&mu);
    for (const std::string& line : log) {
      if (absl::StrContains(line, text)) return true;
    }
    return false;
  }

  void WaitForLog(const std::string& text) {
    for (int i = 0; i < 1000 && !Logged(text); ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_TRUE(Logged(text)) << "never logged: " << text;
  }

  int Rounds() {
    absl::MutexLock lock(&mu);
    return rounds;
  }
};

class FakeRendezvous : public RendezvousClient {
 public:
  explicit FakeRendezvous(World* world) : world_(world) {}

  absl::StatusOr<RendezvousResult> Join(
      const RendezvousOptions& options) override {
    if (world_->join_gate != nullptr) {
      world_->join_gate->WaitForNotification();
    }
    absl::MutexLock lock(&world_->mu);
    RendezvousResult result;
    result.round = ++world_->rounds;
    result.num_nodes = world_->nodes;
    result.world_size = world_->nodes * options.local_world_size;
    result.store_prefix =
        absl::StrCat("/rdzv/", options.run_id, "/", result.round);
    for (int i = 0; i < world_->nodes; ++i) {
      RendezvousPeer peer;
      peer.node_id = i == 0 ? options.node_id : "node-b";
      peer.node_rank = i;
      peer.local_world_size = options.local_world_size;
      peer.first_global_rank = i * options.local_world_size;
      result.peers.push_back(peer);
    }
    return result;
  }

  absl::StatusOr<RunStatus> GetRunStatus(const std::string& run_id) override {
    absl::MutexLock lock(&world_->mu);
    return world_->run_status;
  }

  absl::Status CloseRun(const std::string& run_id) override {
    return absl::OkStatus();
  }

 private:
  World* world_;
};

class FakeMember : public GroupMember {
 public:
  FakeMember(World* world, int64_t incarnation)
      : world_(world), incarnation_(incarnation) {}
  ~FakeMember() override { Leave().IgnoreError(); }

  int64_t incarnation() const override { return incarnation_; }

  absl::Status health() const override {
    absl::MutexLock lock(&world_->mu);
    return world_->health;
  }

  absl::Status Barrier(const std::string& barrier_id, absl::Duration timeout,
                       const std::vector<std::string>& participants) override {
    absl::MutexLock lock(&world_->mu);
    world_->barriers.push_back(
        absl::StrCat(barrier_id, " [", absl::StrJoin(participants, " "), "]"));
    if (absl::StrContains(barrier_id, "start")) {
      return std::exchange(world_->start_barrier, absl::OkStatus());
    }
    return absl::OkStatus();
  }

  absl::Status ReportError(const std::string& message) override {
    absl::MutexLock lock(&world_->mu);
    world_->reported_errors.push_back(message);
    return absl::OkStatus();
  }

  absl::Status Leave() override {
    if (left_) return absl::OkStatus();
    left_ = true;
    absl::MutexLock lock(&world_->mu);
    ++world_->leaves;
    return absl::OkStatus();
  }

 private:
  World* world_;
  int64_t incarnation_;
  bool left_ = false;
};

class FakeWatch : public MemberWatch {
 public:
  explicit FakeWatch(World* world) : world_(world) {}
  ~FakeWatch() override { Cancel(); }
  void Cancel() override {
    absl::MutexLock lock(&world_->mu);
    world_->watcher = [](const MemberEvent&) {};
    cancelled_ = true;
  }
  absl::Status Wait() override {
    absl::MutexLock lock(&world_->mu);
    world_->mu.Await(absl::Condition(&cancelled_));
    return absl::OkStatus();
  }

 private:
  World* world_;
  bool cancelled_ = false;
};

class FakeMembership : public MembershipClient {
 public:
  explicit FakeMembership(World* world) : world_(world) {}

  absl::StatusOr<std::unique_ptr<GroupMember>> JoinGroup(
      const MemberOptions& options) override {
    absl::MutexLock lock(&world_->mu);
    return std::make_unique<FakeMember>(world_, world_->next_incarnation++);
  }

  absl::StatusOr<std::vector<Member>> ListMembers(
      const std::string& group) override {
    absl::MutexLock lock(&world_->mu);
    std::vector<Member> members;
    if (world_->nodes > 1 && world_->peer_group_rank >= 0) {
      members.push_back(Member{"node-b", 100 + world_->rounds,
                               world_->peer_group_rank, "host-b"});
    }
    members.push_back(Member{"node-a", world_->next_incarnation - 1, 0, "a"});
    return members;
  }

  absl::StatusOr<std::unique_ptr<MemberWatch>> Watch(
      const std::string& group, MemberEventCallback callback) override {
    absl::MutexLock lock(&world_->mu);
    world_->watcher = std::move(callback);
    return std::make_unique<FakeWatch>(world_);
  }

 private:
  World* world_;
};

class LauncherTest : public ::testing::Test {
 protected:
  LauncherTest() : dir_(::testing::TempDir()) {
    options_.run_id = "job";
    options_.node_id = "node-a";
    options_.hostname = "host-a";
    options_.coordinator = "cohortd.example:29511";
    // Nothing listens there; only the proxy test's workers connect to it,
    // and it sets its own.
    options_.tcpstore = "127.0.0.1:1";
    options_.stop_grace = absl::Seconds(2);
    options_.poll_interval = absl::Milliseconds(10);
    options_.run_status_interval = absl::Milliseconds(50);
    options_.log = [this](const std::string& line) {
      absl::MutexLock lock(&world_.mu);
      world_.log.push_back(line);
    };
  }

  // Runs `script` under sh as the workers.
  std::unique_ptr<Launcher> MakeLauncher(const std::string& script) {
    options_.command = {"sh", "-c", script};
    return std::make_unique<Launcher>(
        options_, std::make_unique<FakeRendezvous>(&world_),
        std::make_unique<FakeMembership>(&world_));
  }

  std::string Log() {
    absl::MutexLock lock(&world_.mu);
    return absl::StrJoin(world_.log, "\n");
  }

  const std::string dir_;
  World world_;
  LauncherOptions options_;
};

TEST_F(LauncherTest, RunsWorkersWithTheTorchrunEnvironment) {
  world_.nodes = 2;
  options_.nproc_per_node = 2;
  options_.max_restarts = 3;
  for (const char* name : {"OMP_NUM_THREADS", "NCCL_ASYNC_ERROR_HANDLING",
                           "TORCH_NCCL_ASYNC_ERROR_HANDLING"}) {
    unsetenv(name);
  }
  auto launcher = MakeLauncher(absl::StrCat(
      "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK "
      "$GROUP_WORLD_SIZE $COHORT_ADDR "
      "$COHORT_RUN_ID $COHORT_ROUND $COHORT_STORE_PREFIX "
      "$COHORT_RESTART_COUNT > ",
      dir_,
      "/env.$RANK; "
      "echo $ROLE_RANK $ROLE_NAME $ROLE_WORLD_SIZE $MASTER_ADDR "
      "$TORCHELASTIC_USE_AGENT_STORE $TORCHELASTIC_RESTART_COUNT "
      "$TORCHELASTIC_MAX_RESTARTS $TORCHELASTIC_RUN_ID "
      "$TORCH_NCCL_ASYNC_ERROR_HANDLING $NCCL_ASYNC_ERROR_HANDLING "
      "$OMP_NUM_THREADS >> ",
      dir_,
      "/env.$RANK; echo $COHORT_MEMBER_GROUP $COHORT_MEMBER_NAME "
      "$COHORT_MEMBER_INCARNATION >> ",
      dir_, "/env.$RANK; echo $MASTER_PORT > ", dir_, "/port.$RANK"));
  EXPECT_EQ(launcher->Run(), 0) << Log();
  for (int rank : {0, 1}) {
    EXPECT_EQ(ReadFile(absl::StrCat(dir_, "/env.", rank)),
              absl::StrCat(rank, " ", rank,
                           " 4 2 0 2 cohortd.example:29511 job 1 /rdzv/job/1 "
                           "0\n",
                           rank, " default 4 127.0.0.1 True 1 3 job 1 1 1\n",
                           "job node-a 1\n"));
  }
  // MASTER_PORT is the node's proxy, the same for both.
  const std::string port = ReadFile(absl::StrCat(dir_, "/port.0"));
  EXPECT_EQ(ReadFile(absl::StrCat(dir_, "/port.1")), port);
  EXPECT_THAT(Log(), HasSubstr(absl::StrCat(
                         "round 1: workers' torch store 127.0.0.1:",
                         absl::StripAsciiWhitespace(port),
                         " is cohortd's 127.0.0.1:1 under /cohortrun/job/1/")));
  EXPECT_THAT(Log(), HasSubstr("setting OMP_NUM_THREADS=1 for each of the 2 "
                               "workers (as torchrun does)"));
  EXPECT_THAT(world_.barriers,
              ElementsAre("cohortrun.round-1.start [node-a node-b]",
                          "cohortrun.round-1.exit [node-a node-b]"));
  EXPECT_EQ(world_.leaves, 1);
  EXPECT_THAT(Log(), HasSubstr("joining run job (nodes 1:1) as node-a"));
  EXPECT_THAT(Log(), HasSubstr("round 1: node rank 0 of 2, world size 4, "
                               "ranks 0-1"));
}

// The workers' MASTER_ADDR:MASTER_PORT reaches cohortd's TCPStore port
// through the node's proxy, each round under its own namespace.
TEST_F(LauncherTest, WorkersReachTheTcpStoreThroughTheProxyPerRound) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
            0);
  ASSERT_EQ(listen(listener, 8), 0);
  socklen_t len = sizeof(addr);
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  options_.tcpstore = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  // What each connection to the fake cohortd carried, hello included.
  std::vector<std::string> received;
  std::thread cohortd([&] {
    for (int i = 0; i < 2; ++i) {
      const int fd = accept(listener, nullptr, nullptr);
      if (fd < 0) return;
      std::string bytes;
      char buf[256];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) {
        bytes.append(buf, n);
      }
      close(fd);
      received.push_back(bytes);
    }
  });
  options_.max_restarts = 1;
  options_.command = {
      "bash", "-c",
      "exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT && printf "
      "\"round $TORCHELASTIC_RESTART_COUNT\" >&3 && exec 3>&- && "
      "[ $TORCHELASTIC_RESTART_COUNT = 2 ]"};
  Launcher launcher(options_, std::make_unique<FakeRendezvous>(&world_),
                    std::make_unique<FakeMembership>(&world_));
  EXPECT_EQ(launcher.Run(), 0) << Log();
  cohortd.join();
  close(listener);
  std::vector<std::string> expected;
  for (int round : {1, 2}) {
    // The namespace hello (proto/tcpstore/wire.h): magic, u32 length.
    const std::string name_space = StoreNamespace("job", round);
    std::string hello = "\xC0NS1";
    hello += static_cast<char>(name_space.size());
    hello += std::string(3, '\0');
    expected.push_back(absl::StrCat(hello, name_space, "round ", round));
  }
  EXPECT_EQ(received, expected);
}

// cohortd serves no TCPStore listener: no proxy, and no torch store
// variables, not even ones cohortrun inherited.
TEST_F(LauncherTest, WithoutATorchStoreWorkersGetNoMasterAddrOrPort) {
  options_.no_torch_store = true;
  options_.tcpstore = "";
  setenv("MASTER_ADDR", "inherited.example", 1);
  auto launcher = MakeLauncher(absl::StrCat(
      "echo \"[$MASTER_ADDR] [$MASTER_PORT] [$TORCHELASTIC_USE_AGENT_STORE] "
      "$COHORT_ADDR\" > ",
      dir_, "/no_store.$RANK"));
  EXPECT_EQ(launcher->Run(), 0) << Log();
  unsetenv("MASTER_ADDR");
  EXPECT_EQ(ReadFile(absl::StrCat(dir_, "/no_store.0")),
            "[] [] [] cohortd.example:29511\n");
  EXPECT_THAT(Log(), ::testing::Not(HasSubstr("workers' torch store")));
}

TEST(LauncherDefaultsTest, TcpStoreAddressAndNamespace) {
  EXPECT_EQ(DefaultTcpStore("cohortd.example:29500"), "cohortd.example:29400");
  EXPECT_EQ(DefaultTcpStore("[::1]:29500"), "[::1]:29400");
  EXPECT_EQ(StoreNamespace("job 7", 3), "/cohortrun/job 7/3/");
}

TEST_F(LauncherTest, RestartsAfterAWorkerFailsAndTellsThePeers) {
  options_.nproc_per_node = 2;
  options_.max_restarts = 1;
  // In the first attempt rank 1 fails while rank 0 would run forever: Run
  // returns only if the launcher stops it (else the test times out).
  auto launcher = MakeLauncher(
      "if [ $COHORT_RESTART_COUNT = 0 ]; then"
      "  if [ $RANK = 1 ]; then exit 3; fi; exec sleep infinity; "
      "fi");
  EXPECT_EQ(launcher->Run(), 0) << Log();
  EXPECT_EQ(world_.rounds, 2);
  EXPECT_THAT(world_.reported_errors, ElementsAre("rank 1 exited with code 3"));
  EXPECT_THAT(Log(), HasSubstr("restarting: rank 1 (local rank 1) failed "
                               "with exit code 3 (restart 1 of 1)"));
  EXPECT_EQ(world_.leaves, 2);
}

TEST_F(LauncherTest, GivesUpAfterMaxRestartsNamingRankHowAndAttempt) {
  options_.nproc_per_node = 2;
  options_.max_restarts = 1;
  auto launcher = MakeLauncher("if [ $RANK = 1 ]; then exit 3; fi");
  EXPECT_EQ(launcher->Run(), 1);
  EXPECT_EQ(world_.rounds, 2);
  EXPECT_THAT(Log(),
              HasSubstr("rank 1 (local rank 1) failed with exit code 3 "
                        "on attempt 2 of 2 (max restarts 1); giving up"));
}

TEST_F(LauncherTest, ReportsAWorkerKilledByASignal) {
  auto launcher = MakeLauncher("kill -SEGV $$");
  EXPECT_EQ(launcher->Run(), 1);
  EXPECT_THAT(world_.reported_errors,
              ElementsAre("rank 0 was killed by signal SIGSEGV"));
  EXPECT_THAT(Log(), HasSubstr("rank 0 (local rank 0) failed with signal "
                               "SIGSEGV on attempt 1 of 1 (max restarts 0)"));
}

TEST_F(LauncherTest, RestartsWhenAPeerOfTheRoundFailsIgnoringHistory) {
  world_.nodes = 2;
  options_.max_restarts = 1;
  auto launcher =
      MakeLauncher("if [ $COHORT_RESTART_COUNT = 0 ]; then exec sleep 30; fi");
  std::thread peer([&] {
    world_.WaitForLog("round 1: running rank 0");
    // node-b's incarnation in round 1 is 101. Events of other incarnations,
    // of nodes outside the round, of this node and JOINED change nothing.
    world_.Emit(MemberEvent::Type::kFailed, "node-b", 100, "old lease");
    world_.Emit(MemberEvent::Type::kLeft, "node-c", 7);
    world_.Emit(MemberEvent::Type::kErrorReported, "node-a", 1, "mine");
    world_.Emit(MemberEvent::Type::kJoined, "node-b", 101);
    absl::SleepFor(absl::Milliseconds(300));
    EXPECT_EQ(world_.Rounds(), 1);
    world_.Emit(MemberEvent::Type::kFailed, "node-b", 101, "lease expired");
  });
  EXPECT_EQ(launcher->Run(), 0) << Log();
  peer.join();
  EXPECT_EQ(world_.rounds, 2);
  EXPECT_THAT(Log(), HasSubstr("restarting: peer node-b failed: lease "
                               "expired (restart 1 of 1)"));
  EXPECT_THAT(world_.reported_errors, IsEmpty());
}

TEST_F(LauncherTest, RestartsWhenAPeerReportsAnErrorOrLeaves) {
  world_.nodes = 2;
  options_.max_restarts = 2;
  auto launcher = MakeLauncher(
      "if [ $COHORT_RESTART_COUNT -lt 2 ]; then exec sleep 30; fi");
  std::thread peer([&] {
    world_.WaitForLog("round 1: running");
    world_.Emit(MemberEvent::Type::kErrorReported, "node-b", 101,
                "rank 1 exited with code 1");
    world_.WaitForLog("round 2: running");
    world_.Emit(MemberEvent::Type::kLeft, "node-b", 102);
  });
  EXPECT_EQ(launcher->Run(), 0) << Log();
  peer.join();
  EXPECT_THAT(Log(), HasSubstr("restarting: peer node-b reported an error: "
                               "rank 1 exited with code 1 (restart 1 of 2)"));
  EXPECT_THAT(Log(), HasSubstr("restarting: peer node-b left the group "
                               "(restart 2 of 2)"));
}

TEST_F(LauncherTest, RestartsForWaitingNodesWithoutCountingARestart) {
  options_.min_nodes = 1;
  options_.max_nodes = 2;
  world_.run_status.round = 1;
  world_.run_status.phase = RunStatus::Phase::kComplete;
  world_.run_status.num_waiting = 1;
  auto launcher = MakeLauncher(
      absl::StrCat("echo $COHORT_ROUND $COHORT_RESTART_COUNT > ", dir_,
                   "/scale; "
                   "if [ $COHORT_ROUND = 1 ]; then exec sleep 30; fi"));
  EXPECT_EQ(launcher->Run(), 0) << Log();
  EXPECT_EQ(ReadFile(absl::StrCat(dir_, "/scale")), "2 0\n");
  EXPECT_THAT(Log(), HasSubstr("restarting: 1 node waiting to join run job "
                               "(round 1 has 1 of at most 2)"));
}

TEST_F(LauncherTest, AFullRoundIgnoresWaitingNodes) {
  world_.run_status.round = 1;
  world_.run_status.num_waiting = 1;
  auto launcher = MakeLauncher("sleep 0.3");
  EXPECT_EQ(launcher->Run(), 0) << Log();
  EXPECT_EQ(world_.rounds, 1);
}

TEST_F(LauncherTest, APeerThatNeverJoinsTheGroupCostsARestart) {
  world_.nodes = 2;
  world_.peer_group_rank = -1;
  options_.group_join_timeout = absl::Milliseconds(300);
  auto launcher = MakeLauncher("true");
  EXPECT_EQ(launcher->Run(), 1);
  EXPECT_THAT(Log(), HasSubstr("round 1 could not start: after 300ms, 1 node "
                               "had not joined group job: node-b on attempt 1 "
                               "of 1"));
}

TEST_F(LauncherTest, APeersMembershipFromAnEarlierRoundDoesNotCount) {
  world_.nodes = 2;
  world_.peer_group_rank = 0;  // Its node rank in this round is 1.
  options_.group_join_timeout = absl::Milliseconds(300);
  auto launcher = MakeLauncher("true");
  EXPECT_EQ(launcher->Run(), 1);
  EXPECT_THAT(Log(), HasSubstr("1 node had not joined group job: node-b"));
}

TEST_F(LauncherTest, APeerFailingAsTheRoundStartsCostsARestart) {
  world_.nodes = 2;
  options_.max_restarts = 1;
  world_.start_barrier = absl::AbortedError(
      "barrier 'cohortrun.round-1.start' aborted: rank 1 (host-b) failed");
  auto launcher = MakeLauncher("true");
  EXPECT_EQ(launcher->Run(), 0) << Log();
  EXPECT_EQ(world_.rounds, 2);
  EXPECT_THAT(Log(), HasSubstr("restarting: round 1 could not start: barrier "
                               "'cohortrun.round-1.start' aborted: rank 1 "
                               "(host-b) failed (restart 1 of 1)"));
}

TEST_F(LauncherTest, RestartsWhenThisNodeLosesItsMembership) {
  options_.max_restarts = 1;
  world_.health = absl::NotFoundError("declared failed");
  auto launcher = MakeLauncher("sleep 30");
  EXPECT_EQ(launcher->Run(), 1);
  EXPECT_THAT(Log(), HasSubstr("this node lost its membership in group job: "
                               "declared failed on attempt 2 of 2"));
}

TEST_F(LauncherTest, StopForwardsTheSignalAndReturnsTheWorkersStatus) {
  options_.nproc_per_node = 2;
  auto launcher = MakeLauncher("exec sleep 30");
  std::thread stopper([&] {
    world_.WaitForLog("round 1: running");
    EXPECT_TRUE(launcher->Stop(SIGTERM));
  });
  EXPECT_EQ(launcher->Run(), 128 + SIGTERM);
  stopper.join();
  EXPECT_THAT(Log(), HasSubstr("forwarding SIGTERM to 2 workers"));
  EXPECT_EQ(world_.leaves, 1);
}

TEST_F(LauncherTest, StopDuringTheRendezvousAsksTheCallerToExit) {
  absl::Notification gate;
  world_.join_gate = &gate;
  auto launcher = MakeLauncher("true");
  std::thread stopper([&] {
    world_.WaitForLog("joining run job");
    EXPECT_FALSE(launcher->Stop(SIGINT));
    gate.Notify();
  });
  EXPECT_EQ(launcher->Run(), 128 + SIGINT);
  stopper.join();
  EXPECT_THAT(Log(), HasSubstr("SIGINT while joining run job (nodes 1:1) as "
                               "node-a, which cannot be interrupted"));
}

TEST_F(LauncherTest, AProgramThatCannotRunIsFatal) {
  options_.max_restarts = 3;
  options_.command = {"/no/such/program"};
  Launcher launcher(options_, std::make_unique<FakeRendezvous>(&world_),
                    std::make_unique<FakeMembership>(&world_));
  EXPECT_EQ(launcher.Run(), 1);
  EXPECT_EQ(world_.rounds, 1);
  ASSERT_EQ(world_.reported_errors.size(), 1);
  EXPECT_THAT(world_.reported_errors[0],
              HasSubstr("node-a cannot start workers: /no/such/program"));
}

TEST(ParseNodeRangeTest, AcceptsNAndMinMax) {
  EXPECT_EQ(*ParseNodeRange("3"), std::make_pair(3, 3));
  EXPECT_EQ(*ParseNodeRange("2:4"), std::make_pair(2, 4));
  EXPECT_FALSE(ParseNodeRange("0").ok());
  EXPECT_FALSE(ParseNodeRange("4:2").ok());
  EXPECT_FALSE(ParseNodeRange("1:2:3").ok());
  EXPECT_FALSE(ParseNodeRange("two").ok());
}

}  // namespace
}  // namespace cohort

// Keepalive tells a dead peer from a busy one, with real processes: a
// stopped cohortd keeps its clients' parked calls, a stopped client keeps
// its connection to cohortd, and a client whose network is cut is dropped
// within cohortd's --keepalive_time + --keepalive_timeout.
//
// SIGSTOP stands for starvation at its worst: a process given no CPU at
// all, for longer than any keepalive timeout, which hog processes on a
// busy machine can only approach. Its kernel still answers TCP.
//
// The test runs in a network namespace of its own when it may (it is root
// and unshare(CLONE_NEWNET) works), so that it can take its loopback down
// to cut a client off; elsewhere that case is skipped.
#include <dirent.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/membership_client.h"
#include "client/remote_store.h"
#include "gtest/gtest.h"
#include "tests/testing/cohortd_process.h"

extern char** environ;

namespace cohort {
namespace {

using testing::CohortdProcess;

bool in_own_netns = false;

// cohortd's keepalive in these tests: a dead peer is dropped within
// kTime + kTimeout = 3 s of its last sign of life.
constexpr absl::Duration kTime = absl::Seconds(1);
constexpr absl::Duration kTimeout = absl::Seconds(2);
// How long a process is stopped: three times what a dead one is given.
const absl::Duration kStopped = 3 * (kTime + kTimeout);
// A generous bound on detecting a dead one (ten times the configured one),
// for a loaded machine.
const absl::Duration kDetectionBound = 10 * (kTime + kTimeout);

absl::StatusOr<CohortdProcess> StartCohortd() {
  return CohortdProcess::Start(
      {"--engine=memory",
       absl::StrCat("--keepalive_time=", absl::FormatDuration(kTime)),
       absl::StrCat("--keepalive_timeout=", absl::FormatDuration(kTimeout))});
}

ConnectionOptions At(const CohortdProcess& cohortd) {
  ConnectionOptions options;
  options.address = cohortd.address();
  options.connect_timeout = absl::Seconds(30);
  options.keepalive = {.idle = kTime, .timeout = kTimeout};
  return options;
}

// An established TCP connection, from /proc/net/tcp{,6}.
struct TcpConn {
  int local_port = 0;
  int remote_port = 0;
  uint64_t inode = 0;
};

std::vector<TcpConn> Established() {
  std::vector<TcpConn> out;
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // Header.
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
      if (f.size() < 10 || f[3] != "01") continue;
      TcpConn c;
      auto port = [](const std::string& addr) {
        int p = 0;
        absl::SimpleHexAtoi(addr.substr(addr.rfind(':') + 1), &p);
        return p;
      };
      c.local_port = port(f[1]);
      c.remote_port = port(f[2]);
      absl::SimpleAtoi(f[9], &c.inode);
      out.push_back(c);
    }
  }
  return out;
}

// The local ports of the connections process `pid` holds to `server_port`.
std::set<int> ClientPorts(pid_t pid, int server_port) {
  std::set<uint64_t> inodes;
  const std::string dir_name = absl::StrCat("/proc/", pid, "/fd");
  if (DIR* dir = opendir(dir_name.c_str())) {
    while (dirent* e = readdir(dir)) {
      char target[128];
      const std::string link = absl::StrCat(dir_name, "/", e->d_name);
      const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      target[n] = '\0';
      uint64_t inode = 0;
      if (sscanf(target, "socket:[%lu]", &inode) == 1) inodes.insert(inode);
    }
    closedir(dir);
  }
  std::set<int> ports;
  for (const TcpConn& c : Established()) {
    if (c.remote_port == server_port && inodes.count(c.inode) > 0) {
      ports.insert(c.local_port);
    }
  }
  return ports;
}

// Whether cohortd (on `server_port`) holds the connection from `client_port`.
bool ServerHolds(int server_port, int client_port) {
  for (const TcpConn& c : Established()) {
    if (c.local_port == server_port && c.remote_port == client_port) {
      return true;
    }
  }
  return false;
}

void Pause(pid_t pid, absl::Duration how_long) {
  ASSERT_EQ(kill(pid, SIGSTOP), 0);
  absl::SleepFor(how_long);
  ASSERT_EQ(kill(pid, SIGCONT), 0);
}

// A cohortctl process; killed on destruction if still running.
struct Cohortctl {
  pid_t pid = -1;
  ~Cohortctl() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
  int Wait() {
    int status = 0;
    waitpid(pid, &status, 0);
    pid = -1;
    return status;
  }
};

Cohortctl StartCohortctl(const CohortdProcess& cohortd,
                         std::vector<std::string> args) {
  args.insert(args.begin(), {"client/cohortctl", "--addr=" + cohortd.address(),
                             "--connect_timeout=30"});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  Cohortctl ctl;
  EXPECT_EQ(
      posix_spawn(&ctl.pid, argv[0], nullptr, nullptr, argv.data(), environ),
      0);
  return ctl;
}

// Polls `done` until it holds or `bound` passes.
template <typename Done>
bool Eventually(Done done, absl::Duration bound) {
  const absl::Time end = absl::Now() + bound;
  while (!done()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return true;
}

// The client ports of `ctl`'s connections to cohortd, once it has one and
// its call has had time to park there; empty if it never connects.
std::set<int> ParkedOn(const CohortdProcess& cohortd, const Cohortctl& ctl) {
  std::set<int> ports;
  if (Eventually(
          [&] {
            ports = ClientPorts(ctl.pid, cohortd.port());
            return !ports.empty();
          },
          absl::Seconds(30))) {
    absl::SleepFor(absl::Milliseconds(500));
  }
  return ports;
}

// cohortd given no CPU for three times its keepalive: its clients keep a
// parked wait, a barrier and a member watch on their connections, and all
// three complete once it runs again.
TEST(KeepaliveTest, AStoppedCohortdKeepsItsClientsCalls) {
  absl::StatusOr<CohortdProcess> cohortd = StartCohortd();
  ASSERT_TRUE(cohortd.ok()) << cohortd.status();
  auto store = RemoteStore::Connect(At(*cohortd));
  ASSERT_TRUE(store.ok()) << store.status();
  auto members = MembershipClient::Connect(At(*cohortd));
  ASSERT_TRUE(members.ok()) << members.status();
  // Leases long enough to outlast the stop (a lease is cohortd's own
  // failure detection, not the subject here).
  auto join = [&](const std::string& name) {
    MemberOptions o;
    o.group = "job";
    o.name = name;
    o.heartbeat_interval = absl::Seconds(1);
    o.missed_heartbeats = 60;
    return (*members)->JoinGroup(o);
  };
  auto a = join("a");
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = join("b");
  ASSERT_TRUE(b.ok()) << b.status();
  std::atomic<int> joined_c{0};
  auto watch = (*members)->Watch("job", [&](const MemberEvent& e) {
    if (e.type == MemberEvent::Type::kJoined && e.member.name == "c") {
      ++joined_c;
    }
  });
  ASSERT_TRUE(watch.ok()) << watch.status();

  absl::Status waited = absl::UnknownError("not yet"),
               barrier = absl::UnknownError("not yet");
  std::thread waiter(
      [&] { waited = (*store)->Wait({"go"}, absl::Seconds(300)); });
  std::thread arriver(
      [&] { barrier = (*a)->Barrier("sync", absl::Seconds(300)); });
  absl::SleepFor(absl::Seconds(1));  // The calls reach cohortd and park.
  const std::set<int> before = ClientPorts(getpid(), cohortd->port());
  ASSERT_FALSE(before.empty());

  Pause(cohortd->pid(), kStopped);

  // The same connections, none dropped and redialed.
  for (int port : before) {
    EXPECT_TRUE(ServerHolds(cohortd->port(), port)) << "client port " << port;
  }
  ASSERT_TRUE((*store)->Set("go", "1").ok());
  EXPECT_TRUE((*b)->Barrier("sync", absl::Seconds(60)).ok());
  auto c = join("c");
  ASSERT_TRUE(c.ok()) << c.status();
  waiter.join();
  arriver.join();
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_TRUE(barrier.ok()) << barrier;
  EXPECT_TRUE(
      Eventually([&] { return joined_c.load() == 1; }, absl::Seconds(30)));
  (*watch)->Cancel();
  EXPECT_TRUE((*watch)->Wait().ok());
}

// A client process given no CPU for three times cohortd's keepalive (as a
// process driving 100,000 calls can be) keeps its connection and its
// parked wait: cohortd does not take it for dead.
TEST(KeepaliveTest, AStoppedClientKeepsItsConnection) {
  absl::StatusOr<CohortdProcess> cohortd = StartCohortd();
  ASSERT_TRUE(cohortd.ok()) << cohortd.status();
  auto store = RemoteStore::Connect(At(*cohortd));
  ASSERT_TRUE(store.ok()) << store.status();
  Cohortctl waiting = StartCohortctl(*cohortd, {"wait", "go"});
  const std::set<int> ports = ParkedOn(*cohortd, waiting);
  ASSERT_FALSE(ports.empty());

  Pause(waiting.pid, kStopped);

  for (int port : ports) {
    EXPECT_TRUE(ServerHolds(cohortd->port(), port)) << "client port " << port;
  }
  ASSERT_TRUE((*store)->Set("go", "1").ok());
  const int status = waiting.Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// Sets the loopback interface of this network namespace up or down.
bool SetLoopback(bool up) {
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0) return false;
  ifreq ifr{};
  std::snprintf(ifr.ifr_name, IFNAMSIZ, "lo");
  bool ok = ioctl(fd, SIOCGIFFLAGS, &ifr) == 0;
  if (up) {
    ifr.ifr_flags |= IFF_UP;
  } else {
    ifr.ifr_flags &= ~IFF_UP;
  }
  ok = ok && ioctl(fd, SIOCSIFFLAGS, &ifr) == 0;
  close(fd);
  return ok;
}

// A client whose network is cut (its packets go nowhere, as when its host
// dies) is dropped by cohortd within the keepalive bound, and its parked
// call with it; cohortd serves new clients after.
TEST(KeepaliveTest, ACutOffClientIsDropped) {
  if (!in_own_netns) {
    GTEST_SKIP() << "needs a network namespace of its own (root)";
  }
  absl::StatusOr<CohortdProcess> cohortd = StartCohortd();
  ASSERT_TRUE(cohortd.ok()) << cohortd.status();
  Cohortctl waiting = StartCohortctl(*cohortd, {"wait", "never"});
  const std::set<int> ports = ParkedOn(*cohortd, waiting);
  ASSERT_FALSE(ports.empty());
  // The client's own keepalive (cohortctl's default, a minute) must not be
  // what ends it: stop it, so only cohortd can act.
  ASSERT_EQ(kill(waiting.pid, SIGSTOP), 0);

  ASSERT_TRUE(SetLoopback(false));
  const absl::Time cut = absl::Now();
  const bool dropped = Eventually(
      [&] {
        for (int port : ports) {
          if (ServerHolds(cohortd->port(), port)) return false;
        }
        return true;
      },
      kDetectionBound);
  const absl::Duration took = absl::Now() - cut;
  ASSERT_TRUE(SetLoopback(true));
  EXPECT_TRUE(dropped) << "cohortd still holds the connection after "
                       << absl::FormatDuration(took);

  auto store = RemoteStore::Connect(At(*cohortd));
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->Set("after", "1").ok());
}

// Moves the whole process (before any thread starts) into a network
// namespace of its own, with its loopback up.
bool EnterOwnNetworkNamespace() {
  return geteuid() == 0 && unshare(CLONE_NEWNET) == 0 && SetLoopback(true);
}

}  // namespace
}  // namespace cohort

int main(int argc, char** argv) {
  cohort::in_own_netns = cohort::EnterOwnNetworkNamespace();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

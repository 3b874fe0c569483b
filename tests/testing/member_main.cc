// A group member as a process of its own, for tests that kill members:
// joins, prints "joined <incarnation>" and heartbeats until killed. With
// --barrier it then waits at that barrier (printing "barrier <id>: <the
// outcome>" when it ends) and goes on heartbeating.

#include <unistd.h>

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "client/membership_client.h"

ABSL_FLAG(std::string, addr, "", "cohortd HOST:PORT");
ABSL_FLAG(std::string, group, "", "group to join");
ABSL_FLAG(std::string, name, "", "member name");
ABSL_FLAG(int, rank, -1, "member rank");
ABSL_FLAG(std::string, host, "", "member host");
ABSL_FLAG(int, interval_ms, 200, "heartbeat interval");
ABSL_FLAG(std::string, barrier, "", "a barrier to wait at once joined");
ABSL_FLAG(std::string, barrier_participants, "",
          "its participants, comma-separated (empty: every live member)");
ABSL_FLAG(int, barrier_timeout_s, 600, "how long to wait at the barrier");
ABSL_FLAG(int, barrier_after_members, 0,
          "arrive at the barrier once the group has this many live members "
          "(named participants must be members when the first arrives)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  cohort::ConnectionOptions connection;
  connection.address = absl::GetFlag(FLAGS_addr);
  auto client = cohort::MembershipClient::Connect(connection);
  if (!client.ok()) return 1;
  cohort::MemberOptions options;
  options.group = absl::GetFlag(FLAGS_group);
  options.name = absl::GetFlag(FLAGS_name);
  options.rank = absl::GetFlag(FLAGS_rank);
  options.host = absl::GetFlag(FLAGS_host);
  options.heartbeat_interval =
      absl::Milliseconds(absl::GetFlag(FLAGS_interval_ms));
  auto member = (*client)->JoinGroup(options);
  if (!member.ok()) {
    std::fprintf(stderr, "join failed: %s\n",
                 member.status().ToString().c_str());
    return 1;
  }
  std::printf("joined %lld\n",
              static_cast<long long>((*member)->incarnation()));
  std::fflush(stdout);
  if (const std::string barrier = absl::GetFlag(FLAGS_barrier);
      !barrier.empty()) {
    const std::vector<std::string> participants = absl::StrSplit(
        absl::GetFlag(FLAGS_barrier_participants), ',', absl::SkipEmpty());
    for (;;) {
      auto members = (*client)->ListMembers(options.group);
      if (members.ok() && static_cast<int>(members->size()) >=
                              absl::GetFlag(FLAGS_barrier_after_members)) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    const absl::Status passed = (*member)->Barrier(
        barrier, absl::Seconds(absl::GetFlag(FLAGS_barrier_timeout_s)),
        participants);
    std::printf("barrier %s: %s\n", barrier.c_str(), passed.ToString().c_str());
    std::fflush(stdout);
  }
  for (;;) pause();
}

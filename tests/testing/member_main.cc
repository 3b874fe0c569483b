// A group member as a process of its own, for tests that kill members:
// joins, prints "joined <incarnation>" and heartbeats until killed.

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "client/membership_client.h"

ABSL_FLAG(std::string, addr, "", "cohortd HOST:PORT");
ABSL_FLAG(std::string, group, "", "group to join");
ABSL_FLAG(std::string, name, "", "member name");
ABSL_FLAG(int, rank, -1, "member rank");
ABSL_FLAG(std::string, host, "", "member host");
ABSL_FLAG(int, interval_ms, 200, "heartbeat interval");

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
  for (;;) pause();
}

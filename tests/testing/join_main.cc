// A rendezvous node as a process of its own, for tests that drive cohortd
// from a shell: joins the run's next round, prints
// "round <round> node_rank <rank>" and exits (1 if the join failed).
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "client/rendezvous_client.h"

ABSL_FLAG(std::string, addr, "", "cohortd HOST:PORT");
ABSL_FLAG(std::string, run, "", "run to join");
ABSL_FLAG(std::string, node, "", "node id");
ABSL_FLAG(std::string, address, "", "how peers reach the node");
ABSL_FLAG(int, local_world_size, 1, "workers on the node");
ABSL_FLAG(int, nnodes, 1, "min_nodes and max_nodes of the run");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  cohort::ConnectionOptions connection;
  connection.address = absl::GetFlag(FLAGS_addr);
  auto client = cohort::RendezvousClient::Connect(connection);
  if (!client.ok()) {
    std::fprintf(stderr, "connect failed: %s\n",
                 client.status().ToString().c_str());
    return 1;
  }
  cohort::RendezvousOptions options;
  options.run_id = absl::GetFlag(FLAGS_run);
  options.node_id = absl::GetFlag(FLAGS_node);
  options.address = absl::GetFlag(FLAGS_address);
  options.local_world_size = absl::GetFlag(FLAGS_local_world_size);
  options.min_nodes = absl::GetFlag(FLAGS_nnodes);
  options.max_nodes = absl::GetFlag(FLAGS_nnodes);
  options.join_timeout = absl::Seconds(60);
  auto joined = (*client)->Join(options);
  if (!joined.ok()) {
    std::fprintf(stderr, "join failed: %s\n",
                 joined.status().ToString().c_str());
    return 1;
  }
  std::printf("round %lld node_rank %d\n",
              static_cast<long long>(joined->round), joined->node_rank);
  return 0;
}

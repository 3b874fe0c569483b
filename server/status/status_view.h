// What cohortd's status API reports (GET /api/status), as plain data, and
// its JSON. Gathered from the live objects by status_gather.h; everything
// here is a pure function of its arguments (the clock included), so every
// field is unit-tested from values.
//
// The JSON, field by field (times are Unix milliseconds, ages and spans
// milliseconds; a field the viewer may not see is left out):
//   time_unix_ms, revision        the clock and the store's revision
//   keys                          every key in the store (admins and with
//                                 auth off only)
//   coordinating                  false on an HA follower replica: runs and
//                                 groups live on the leader
//   viewer                        "auth off", or the token's role and prefix
//   runs[]                        run, phase (COLLECTING, COMPLETE, CLOSED),
//                                 round, min_nodes, max_nodes, num_nodes,
//                                 num_waiting, nodes[] (node_id, address,
//                                 node_rank, local_world_size,
//                                 first_global_rank), nodes_unlisted, keys
//                                 (under runs/RUN/ and /cohortrun/RUN/),
//                                 diagnosis (null without flight dumps:
//                                 round, as_of_unix_ms, errors[], groups[]:
//                                 group, ranks_dumped, text, findings[]:
//                                 kind, ranks[], seq, sentence)
//   runs_unlisted
//   groups[]                      group, members_total, members_alive,
//                                 members_unlisted, members[] (name, rank,
//                                 host, incarnation, state: alive, error,
//                                 failed or left; message,
//                                 heartbeat_interval_ms, missed_heartbeats,
//                                 last_heartbeat_ms_ago, lease_left_ms),
//                                 barriers[] (barrier, generation,
//                                 participants, arrived, missing[]: name,
//                                 rank, host; missing_unlisted, waiting_ms,
//                                 timeout_ms)
//   groups_unlisted
#ifndef COHORT_SERVER_STATUS_STATUS_VIEW_H_
#define COHORT_SERVER_STATUS_STATUS_VIEW_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "cohort/v1/coordination.pb.h"
#include "proto/flight/flight_keys.h"
#include "server/coordination/membership.h"

namespace cohort::server {

// A run's latest flight dumps, diagnosed.
struct RunDiagnosis {
  int64_t round = 0;
  std::vector<flight::GroupDiagnosis> groups;
  // Dumps that did not parse, and bounds that cut the reading short.
  std::vector<std::string> errors;
  absl::Time as_of;
};

struct RunView {
  std::string run;
  v1::RunState state;                     // Without participants.
  std::vector<v1::Participant> nodes;     // The first of num_participants.
  std::optional<int64_t> keys;            // Under the run's namespaces.
  std::optional<RunDiagnosis> diagnosis;  // None: no flight dumps.
};

struct StatusView {
  absl::Time now;
  int64_t revision = 0;
  std::optional<int64_t> keys;  // Every key: for those who may see all.
  bool coordinating = true;
  std::string viewer;
  std::vector<RunView> runs;
  size_t runs_unlisted = 0;
  std::vector<GroupSnapshot> groups;
  size_t groups_unlisted = 0;
};

// The status API's JSON (the header comment lists its fields).
std::string StatusJson(const StatusView& view);

// The state the page shows for a member: "alive", "error" (alive, but it
// reported an error), "failed" or "left".
const char* MemberState(const MemberSnapshot& member);

// When `member` last renewed its lease (its join, a heartbeat, or the
// cohortd start that extended every lease).
absl::Time LastRenewal(const MemberSnapshot& member);

// Diagnoses a run's flight dumps, given as (key, value) pairs of one round
// (flight_keys.h), with each rank's liveness read from `group` (the run's
// group, whose member names are the dumps' nodes; null: unknown). A value
// that does not parse is named in `errors` and left out.
RunDiagnosis DiagnoseDumps(
    const std::vector<std::pair<std::string, std::string>>& dumps,
    const GroupSnapshot* group, absl::Time now);

}  // namespace cohort::server

#endif  // COHORT_SERVER_STATUS_STATUS_VIEW_H_

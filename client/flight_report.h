// What `cohortctl dump RUN` and `cohortctl diagnose RUN` print: a run's
// flight dumps requested and collected (client/flight_catalog.h), and the
// diagnosis of its newest round (proto/flight/diagnose.h) with each node's
// liveness from membership.
#ifndef COHORT_CLIENT_FLIGHT_REPORT_H_
#define COHORT_CLIENT_FLIGHT_REPORT_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/membership_client.h"
#include "client/store.h"
#include "proto/flight/diagnose.h"

namespace cohort {

struct FlightReportOptions {
  // Ask every rank to dump first, and wait this long for their answers.
  bool request = true;
  absl::Duration answer_timeout = absl::Seconds(10);
  flight::DiagnoseOptions diagnose;
  // The round diagnosed; -1: the newest one with dumps.
  int64_t round = -1;
};

// Requests a dump and waits for the answers; the report says who answered
// and who did not ("group 0: ranks 0-3 answered request 4; no answer from
// rank 5"). NOT_FOUND when no rank of the run has ever dumped.
absl::StatusOr<std::string> DumpReport(Store& store, const std::string& run,
                                       const FlightReportOptions& options);

// Liveness by node name from the members of the run's group: a listed
// member is alive, with its heartbeat's age; a node in `nodes` that is not
// listed is dead (failed or left), its last heartbeat unknown. Empty when
// the group has no members (the job is over): nothing is known.
std::map<std::string, flight::Liveness> LivenessByNode(
    const std::vector<Member>& members, const std::vector<std::string>& nodes);

// The diagnosis of the run's newest round, group by group, with a header
// line per group; `members`: the run's group in membership (null: no
// liveness). NOT_FOUND when the run has no dumps.
absl::StatusOr<std::string> DiagnoseReport(Store& store,
                                           MembershipClient* members,
                                           const std::string& run,
                                           const FlightReportOptions& options);

}  // namespace cohort

#endif  // COHORT_CLIENT_FLIGHT_REPORT_H_

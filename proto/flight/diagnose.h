// Diagnosis of a job from its ranks' flight records (flight.proto): lines
// the ranks' rings of one group up by sequence number and says, in a
// sentence a person can act on, why the group is stuck or slow:
//  - which ranks are inside which op, and which rank never entered it
//    ("ranks 0-2,4-7 are in AllReduce #1042 of group 0 (f32, 1048576
//    elements) since 12:03:41; rank 3 last completed #1041 and has not
//    entered #1042 (its last heartbeat was 2 s ago)");
//  - ranks that issued different ops at the same sequence number, or the
//    same op with different sizes, dtypes, reduce ops or roots;
//  - ranks that are dead (from membership) or sent no records;
//  - ops that failed, with their errors;
//  - the slowest rank to enter ops over the last N completed ones
//    (stragglers). Start times come from each rank's clock: on several
//    hosts this assumes their clocks agree (NTP) to well under the delays
//    it reports.
// Pure: no I/O; cohortctl diagnose and cohortd's status page call it.
#ifndef COHORT_PROTO_FLIGHT_DIAGNOSE_H_
#define COHORT_PROTO_FLIGHT_DIAGNOSE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "proto/cohort/v1/flight.pb.h"

namespace cohort::flight {

// What membership knows of a rank (its node's member): whether it is
// alive, and how long ago it last heartbeated.
struct Liveness {
  bool alive = true;
  absl::Duration since_heartbeat = absl::ZeroDuration();
  // Unknown (left out of sentences) when false: a dead member's last
  // heartbeat is not listed.
  bool heartbeat_known = true;
};

struct Finding {
  enum class Kind {
    kHang,              // Ranks inside an op that others have not entered.
    kMismatch,          // Different ops at one seq.
    kArgumentMismatch,  // The same op with different sizes/dtypes/roots.
    kDead,              // Dead in membership, or no records at all.
    kFailed,            // An op that ended with an error.
    kStraggler,         // The rank that entered ops last, most often.
  };
  Kind kind;
  std::vector<int> ranks;  // The ranks the finding is about (the culprits).
  uint64_t seq = 0;
  std::string sentence;
};

struct DiagnoseOptions {
  // Ranks the group has (the dumps' world_size when 0).
  int world_size = 0;
  // Completed collectives looked at for stragglers.
  int straggler_window = 50;
  // A rank entering later than the first by less than this is not late.
  absl::Duration straggler_threshold = absl::Milliseconds(1);
};

struct Diagnosis {
  std::vector<Finding> findings;  // The most telling first.
  // Every finding's sentence, one per line; "no problem found: ..." when
  // there are none.
  std::string Text() const;
};

// `dumps`: the records of one group, at most one per rank, any order.
// `liveness`: by rank, what membership says (ranks absent: unknown).
Diagnosis Diagnose(const std::vector<cohort::v1::FlightDump>& dumps,
                   const std::map<int, Liveness>& liveness,
                   const DiagnoseOptions& options = {});

// "0-2,4,6-7": sorted, runs collapsed.
std::string RankRanges(std::vector<int> ranks);

}  // namespace cohort::flight

#endif  // COHORT_PROTO_FLIGHT_DIAGNOSE_H_

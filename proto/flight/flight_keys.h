// Where a run's flight dumps live in the store, and how they are encoded.
// Workers write them (worker/collective/flight_dumper.h), cohortctl dump and
// diagnose read them, and so does cohortd's status page. Keys, under
// FlightPrefix(run) = "runs/<run>/flight/" (covered by the token cohortrun
// mints its workers for the run):
//   request                      a counter: `cohortctl dump RUN` adds 1, and
//                                every rank's dumper, watching it, dumps
//                                each of its groups with FlightDump.request
//                                set to the value it saw;
//   dumps/<round>/<group>/<rank> the rank's latest FlightDump of the group in
//                                cohortrun's round <round> (12 decimal
//                                digits, so rounds list in order), in
//                                protobuf's JSON mapping;
//   answers/<round>/<group>/<rank>
//                                written with the dump, in one MultiSet:
//                                "<request> <reason> <world_size>", a few
//                                bytes, so that waiting for a thousand
//                                ranks' answers reads a few kilobytes, not
//                                their dumps.
// Pure: no I/O.
#ifndef COHORT_PROTO_FLIGHT_FLIGHT_KEYS_H_
#define COHORT_PROTO_FLIGHT_FLIGHT_KEYS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/cohort/v1/flight.pb.h"
#include "proto/flight/diagnose.h"

namespace cohort::flight {

// A dump's value is cut to at most this many bytes by dropping its oldest
// ops (the newest are what a diagnosis reads).
inline constexpr size_t kMaxDumpBytes = 256 * 1024;

std::string FlightPrefix(absl::string_view run);
std::string FlightRequestKey(absl::string_view run);
std::string FlightDumpsPrefix(absl::string_view run);
std::string FlightDumpKey(absl::string_view run, int64_t round,
                          absl::string_view group, int rank);
std::string FlightAnswersPrefix(absl::string_view run);
std::string FlightAnswerKey(absl::string_view run, int64_t round,
                            absl::string_view group, int rank);

// What a rank's answer key says of its latest dump.
struct FlightAnswer {
  int64_t round = 0;
  std::string group;
  int rank = 0;
  int64_t request = 0;
  std::string reason;
  int world_size = 0;
};
std::string EncodeFlightAnswer(const cohort::v1::FlightDump& dump);
// DATA_LOSS naming `key` when key or value are not an answer's.
absl::StatusOr<FlightAnswer> DecodeFlightAnswer(absl::string_view run,
                                                absl::string_view key,
                                                absl::string_view value);

// JSON of `dump`, its oldest ops dropped until it fits in `max_bytes`
// (the ring's count of what it dropped stays in `recorded`).
std::string EncodeFlightDump(cohort::v1::FlightDump dump,
                             size_t max_bytes = kMaxDumpBytes);
// DATA_LOSS naming `key` when the value is not a FlightDump's JSON.
absl::StatusOr<cohort::v1::FlightDump> DecodeFlightDump(
    absl::string_view key, absl::string_view value);

// FlightDump.reason of the dump each rank publishes when it creates a
// group: it names the rank's node before anything goes wrong, so that a
// rank that never dumps again (frozen, cut off) still has a node whose
// liveness a diagnosis can report. Its ops are not a diagnosis's input.
inline constexpr char kStartReason[] = "start";

// One group's diagnosis in a run's round.
struct GroupDiagnosis {
  int64_t round = 0;
  std::string group;
  int ranks_dumped = 0;  // Dumps other than start dumps.
  Diagnosis diagnosis;
};

// Diagnoses the dumps of round `wanted_round` (-1: the newest round among
// `dumps`), group by group (groups in name order). `by_node`: what
// membership says of each node (FlightDump.node); a rank whose node is
// absent has unknown liveness.
std::vector<GroupDiagnosis> DiagnoseRun(
    const std::vector<cohort::v1::FlightDump>& dumps,
    const std::map<std::string, Liveness>& by_node,
    const DiagnoseOptions& options = {}, int64_t wanted_round = -1);

}  // namespace cohort::flight

#endif  // COHORT_PROTO_FLIGHT_FLIGHT_KEYS_H_

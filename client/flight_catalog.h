// The store's side of flight dumps (proto/flight/flight_keys.h has the
// keys): a rank publishes its groups' recent ops, `cohortctl dump` asks
// every rank of a run to publish, and `cohortctl diagnose` reads what they
// published. The recorders and the dumper are the worker's
// (worker/collective/flight_recorder.h, init/flight_dumper.h).
#ifndef COHORT_CLIENT_FLIGHT_CATALOG_H_
#define COHORT_CLIENT_FLIGHT_CATALOG_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/store.h"
#include "cohort/v1/flight.pb.h"
#include "proto/flight/flight_keys.h"

namespace cohort {

class FlightCatalog {
 public:
  // `store` must outlive the catalog; keys are under runs/<run>/flight/.
  FlightCatalog(Store* store, std::string run);

  // The reason of the dump a rank publishes as it creates a group, which
  // names its node (flight_keys.h).
  static constexpr const char* kStartReason = flight::kStartReason;

  const std::string& run() const { return run_; }

  // Asks every rank of the run to dump: adds 1 to the request counter and
  // returns the request's number.
  absl::StatusOr<int64_t> Request();
  // The last request's number; 0 when there was none.
  absl::StatusOr<int64_t> CurrentRequest();
  // Calls `on_request(number)` on the watch's thread for each later
  // request. Returns once the watch is registered.
  absl::StatusOr<std::unique_ptr<WatchHandle>> WatchRequests(
      std::function<void(int64_t)> on_request);

  // Stores `dump` at its key (run, round, group, rank), cut to
  // flight::kMaxDumpBytes, and its answer key, in one MultiSet.
  // dump.run() must be this catalog's run.
  absl::Status Publish(const v1::FlightDump& dump);

  struct Listing {
    std::vector<v1::FlightDump> dumps;    // In key order.
    std::vector<std::string> unreadable;  // "key: why" for values that
                                          // are not dumps.
  };
  // The dumps of round `round` (-1: every round), read in batches that
  // stay well under a call's size limit.
  absl::StatusOr<Listing> List(int64_t round = -1);

  // What each rank's latest dump answered (a few bytes each, so cheap to
  // poll): of round `round`, or of every round (-1).
  struct AnswerList {
    std::vector<flight::FlightAnswer> answers;  // In key order.
    std::vector<std::string> unreadable;
  };
  absl::StatusOr<AnswerList> ListAnswers(int64_t round = -1);

  // Polls the answers until every rank 0..world_size-1 of every group of
  // the newest round has answered request `request` (request >= it), or
  // `timeout` passes; then lists that round's dumps. The ranks that did
  // not answer are in `missing` (by group: "group 0: ranks 2,3").
  struct Answers {
    Listing listing;
    std::vector<std::string> missing;
  };
  absl::StatusOr<Answers> WaitForAnswers(int64_t request,
                                         absl::Duration timeout);

 private:
  Store* const store_;
  const std::string run_;
};

}  // namespace cohort

#endif  // COHORT_CLIENT_FLIGHT_CATALOG_H_

// FlightDumper: publishes this process's flight records (every group's
// FlightRecorder) to cohortd, under the run's prefix, when something goes
// wrong or someone asks (client/flight_catalog.h has the keys):
//  - an op of a registered group fails (a timeout, a peer gone, a broken
//    group): the group's on_op_failure dumps at once, on the op's thread,
//    before the op's Work completes, so a program that exits on the error
//    still leaves its records; further failures within failure_interval
//    make one more dump, that much later, on the dumper's thread;
//  - the process gets SIGUSR1;
//  - `cohortctl dump RUN` (or cohortrun stopping a round) raises the run's
//    request counter, which the dumper watches.
// Other dumps run on the dumper's own thread. It holds each
// group's recorder weakly: a group destroyed is simply no longer dumped.
//
// Under cohortrun (COHORT_ADDR, COHORT_RUN_ID; COHORT_ROUND and
// COHORT_MEMBER_NAME say which round and node) InitProcessGroup registers
// every group it creates with FromEnv()'s process-wide dumper.
#ifndef COHORT_WORKER_COLLECTIVE_INIT_FLIGHT_DUMPER_H_
#define COHORT_WORKER_COLLECTIVE_INIT_FLIGHT_DUMPER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/flight_catalog.h"
#include "client/store.h"
#include "worker/collective/flight_recorder.h"

namespace cohort {

struct FlightDumperOptions {
  std::string run;  // Required.
  int64_t round = 0;
  std::string node;  // This node's member name in the run's group.
  // Failures this soon after a failure's dump are dumped together, once,
  // this long later.
  absl::Duration failure_interval = absl::Seconds(1);
};

// What a group's dump says of the group.
struct FlightGroupInfo {
  std::string name;  // "0", "1", ...: the order groups were created in.
  std::string backend;
  int rank = 0;
  int world_size = 0;
};

class FlightDumper {
 public:
  // Watches the run's request counter and starts the dumper's thread.
  // INVALID_ARGUMENT without a run.
  static absl::StatusOr<std::unique_ptr<FlightDumper>> Start(
      std::shared_ptr<Store> store, FlightDumperOptions options);

  // The process's dumper under cohortrun, created at the first call from
  // the environment (and then SIGUSR1 dumps); null outside cohortrun or
  // when cohortd cannot be reached (said once on stderr).
  static FlightDumper* FromEnv();

  ~FlightDumper();
  FlightDumper(const FlightDumper&) = delete;
  FlightDumper& operator=(const FlightDumper&) = delete;

  // Registers a group's recorder, and publishes its start dump (which
  // names this rank's node; proto/flight/flight_keys.h). `info.name`
  // empty: the next ordinal. Returns the name the group's dumps carry.
  std::string Add(std::shared_ptr<const FlightRecorder> recorder,
                  FlightGroupInfo info);

  // What a group's ProcessGroupOptions.on_op_failure should call: dumps
  // now (at most once per failure_interval; later ones are coalesced).
  void OnOpFailure(const absl::Status& status);

  // Asks the thread to dump every group now ("request", "signal", ...).
  void Trigger(std::string reason);

  // Makes SIGUSR1 trigger this dumper ("signal"). One dumper per process.
  absl::Status HandleSigusr1();

  // Dumps every live group on the caller's thread, answering `request`.
  absl::Status DumpAll(const std::string& reason, int64_t request);

  // Dumps published so far (each group's once per dump, start dumps
  // included).
  int64_t dumps_published() const;

 private:
  struct Group {
    std::weak_ptr<const FlightRecorder> recorder;
    FlightGroupInfo info;
  };

  FlightDumper(std::shared_ptr<Store> store, FlightDumperOptions options,
               int wake_read, int wake_write);
  absl::Status Publish(const Group& group, const std::string& reason,
                       int64_t request);
  void Wake();
  void Run();

  const std::shared_ptr<Store> store_;
  FlightCatalog catalog_;
  const FlightDumperOptions options_;
  const std::string host_;
  const int wake_read_;   // The self-pipe the thread sleeps on.
  const int wake_write_;  // Written to by Trigger and the signal handler.

  mutable absl::Mutex mu_;
  std::vector<Group> groups_ ABSL_GUARDED_BY(mu_);
  int next_group_ ABSL_GUARDED_BY(mu_) = 0;
  std::string pending_reason_ ABSL_GUARDED_BY(mu_);
  bool failure_pending_ ABSL_GUARDED_BY(mu_) = false;
  std::string failure_reason_ ABSL_GUARDED_BY(mu_);  // "timeout", "failed".
  absl::Time last_failure_dump_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t request_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t published_ ABSL_GUARDED_BY(mu_) = 0;

  std::unique_ptr<WatchHandle> watch_;
  std::thread thread_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_INIT_FLIGHT_DUMPER_H_

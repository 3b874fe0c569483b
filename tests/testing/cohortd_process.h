// CohortdProcess: runs the real cohortd binary as a child process for tests
// that need a separate server (kill -9, restarts, thread counts).
#ifndef COHORT_TESTS_TESTING_COHORTD_PROCESS_H_
#define COHORT_TESTS_TESTING_COHORTD_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace cohort::testing {

class CohortdProcess {
 public:
  // Starts bazel's //server:cohortd with --listen=127.0.0.1:<port> (0: any
  // free port) plus `args`, and waits for its "serving" log lines. Unless
  // `args` sets --tcpstore_listen (empty: off), the TCPStore listener takes
  // a free port on 127.0.0.1 (tcpstore_port()).
  static absl::StatusOr<CohortdProcess> Start(std::vector<std::string> args,
                                              int port = 0);

  CohortdProcess(CohortdProcess&& other) noexcept;
  CohortdProcess& operator=(CohortdProcess&& other) noexcept;
  // Kills the process (SIGKILL) if it still runs.
  ~CohortdProcess();

  pid_t pid() const { return pid_; }
  int port() const { return port_; }
  int tcpstore_port() const { return tcpstore_port_; }
  std::string address() const;

  // Sends `signal`, waits for the exit and returns the raw wait status.
  int Stop(int signal);

  // Threads of the process, from /proc/<pid>/status.
  int ThreadCount() const;

  // Everything the process wrote to stderr so far.
  std::string Log();

 private:
  CohortdProcess() = default;

  pid_t pid_ = -1;
  int port_ = 0;
  int tcpstore_port_ = 0;
  int stderr_fd_ = -1;
  std::string log_;
};

}  // namespace cohort::testing

#endif  // COHORT_TESTS_TESTING_COHORTD_PROCESS_H_

// LocalWorkers: the worker processes cohortrun runs on one node for one
// round: spawned together, watched without blocking, stopped together.
//
// Each worker is a fork/exec of the same program with its own environment,
// in a process group of its own, so that a signal reaches everything the
// worker started (a shell's children, a data loader's processes) and a
// Ctrl-C at the terminal reaches only cohortrun, which forwards it once.
// Workers die with cohortrun (PR_SET_PDEATHSIG) so that a launcher killed
// with SIGKILL leaves no training processes holding GPUs.
#ifndef COHORT_WORKER_LAUNCH_LOCAL_WORKERS_H_
#define COHORT_WORKER_LAUNCH_LOCAL_WORKERS_H_

#include <sys/types.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace cohort {

struct WorkerSpec {
  int rank = 0;
  int local_rank = 0;
  // The worker's whole environment, "NAME=value" entries.
  std::vector<std::string> environment;
};

struct LocalWorkersOptions {
  // The program (a path, or a name looked up in $PATH) and its arguments.
  std::vector<std::string> command;
  // Prefix every line a worker writes with "[rank N] ". Off: workers write
  // to stdout_fd/stderr_fd directly, byte for byte.
  bool tee = false;
  // Where worker output goes (tests redirect it).
  int stdout_fd = STDOUT_FILENO;
  int stderr_fd = STDERR_FILENO;
};

// How one worker ended.
struct WorkerExit {
  int rank = 0;
  int local_rank = 0;
  int wait_status = 0;  // As waitpid reports it.

  bool ok() const;
  // "exit code 3" or "signal SIGSEGV".
  std::string Describe() const;
  // The status a shell would report: the exit code, or 128 + the signal.
  int ShellStatus() const;
};

// The "PATH search" of execvp, done before fork: the path of `program`, or
// NOT_FOUND naming it.
absl::StatusOr<std::string> ResolveProgram(const std::string& program);

// "SIGTERM" for SIGTERM; "signal 64" for one without a name.
std::string SignalName(int signal);

class LocalWorkers {
 public:
  // Starts one process per spec, in spec order. If one cannot be started
  // (fork fails, exec fails: the error names the program and errno), those
  // already started are killed and the error returned.
  static absl::StatusOr<std::unique_ptr<LocalWorkers>> Start(
      const LocalWorkersOptions& options, std::vector<WorkerSpec> specs);

  // Kills (SIGKILL) and reaps whatever still runs.
  ~LocalWorkers();

  LocalWorkers(const LocalWorkers&) = delete;
  LocalWorkers& operator=(const LocalWorkers&) = delete;

  // Reaps the workers that have exited, without blocking, and returns those
  // not returned before.
  std::vector<WorkerExit> Poll();

  // True once every worker has been reaped (and, with tee, its output
  // written out).
  bool AllExited() const;

  std::vector<pid_t> pids() const;

  // Sends `signal` to every worker's process group, waits up to `grace` for
  // them to exit, then SIGKILLs what is left. Blocks until all are reaped;
  // returns the exits not returned by Poll before.
  std::vector<WorkerExit> Stop(int signal, absl::Duration grace);

 private:
  struct Worker {
    WorkerSpec spec;
    pid_t pid = -1;
    bool reaped = false;
    bool returned = false;  // By Poll or Stop.
    int wait_status = 0;
  };
  class LineForwarder;

  explicit LocalWorkers(const LocalWorkersOptions& options);

  absl::Status Spawn(const std::string& path, Worker& worker);
  // Reaps `worker` if it exited; `block` waits for it.
  bool Reap(Worker& worker, bool block);
  void SignalAll(int signal);
  std::vector<WorkerExit> TakeNewExits();
  // Once every worker is reaped, lets the tee forwarders finish what is
  // left in their pipes and joins them.
  void FinishOutputIfDone();

  const LocalWorkersOptions options_;
  std::vector<Worker> workers_;
  std::vector<std::unique_ptr<LineForwarder>> forwarders_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_LAUNCH_LOCAL_WORKERS_H_

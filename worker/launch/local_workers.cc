#include "worker/launch/local_workers.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdlib>
#include <thread>
#include <utility>

#include "absl/base/const_init.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace cohort {
namespace {

// Tee forwarders of all workers write through this, one whole line (or a
// run of whole lines) per write, so lines of different ranks never mix.
ABSL_CONST_INIT absl::Mutex output_mu(absl::kConstInit);

void WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // A closed terminal or pipe: output is lost.
    done += n;
  }
}

void ClosePair(int fds[2]) {
  for (int i = 0; i < 2; ++i) {
    if (fds[i] >= 0) close(fds[i]);
    fds[i] = -1;
  }
}

// The child's stdout and stderr pipes (when `tee`) and the pipe its exec
// errno comes back through, all close-on-exec; none left open on error.
absl::Status OpenPipes(bool tee, int out_pipe[2], int err_pipe[2],
                       int exec_errno_pipe[2]) {
  if ((tee &&
       (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0)) ||
      pipe2(exec_errno_pipe, O_CLOEXEC) != 0) {
    int error = errno;
    ClosePair(out_pipe);
    ClosePair(err_pipe);
    ClosePair(exec_errno_pipe);
    return absl::InternalError(absl::StrCat("pipe: ", strerror(error)));
  }
  return absl::OkStatus();
}

// What a forked child needs to exec a worker, all prepared before fork.
struct ChildExec {
  const char* path;
  char* const* argv;
  char* const* envp;
  pid_t parent;
  int out;         // Becomes its stdout.
  int err;         // Becomes its stderr.
  int exec_errno;  // Where errno goes if exec fails.
  const sigset_t* no_signals;
  const struct sigaction* default_action;
};

// In the child between fork and exec: only async-signal-safe calls (the
// parent has threads: gRPC's, the forwarders'), so no allocation.
[[noreturn]] void ExecChild(const ChildExec& c) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != c.parent) _exit(127);  // cohortrun died before prctl.
  if (c.out != STDOUT_FILENO) dup2(c.out, STDOUT_FILENO);
  if (c.err != STDERR_FILENO) dup2(c.err, STDERR_FILENO);
  // cohortrun blocks its stop signals and ignores SIGPIPE; both would be
  // inherited across exec.
  sigaction(SIGPIPE, c.default_action, nullptr);
  sigprocmask(SIG_SETMASK, c.no_signals, nullptr);
  execve(c.path, c.argv, c.envp);
  int error = errno;
  (void)!write(c.exec_errno, &error, sizeof(error));
  _exit(127);
}

// The child's exec errno from the pipe it writes it to, 0 when exec
// succeeded (the pipe closed on exec, CLOEXEC, with nothing to read).
// Closes `fd`.
int ReadExecErrno(int fd) {
  int exec_errno = 0;
  ssize_t n;
  do {
    n = read(fd, &exec_errno, sizeof(exec_errno));
  } while (n < 0 && errno == EINTR);
  close(fd);
  return n == sizeof(exec_errno) ? exec_errno : 0;
}

}  // namespace

bool WorkerExit::ok() const {
  return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0;
}

std::string WorkerExit::Describe() const {
  if (WIFEXITED(wait_status)) {
    return absl::StrCat("exit code ", WEXITSTATUS(wait_status));
  }
  if (WIFSIGNALED(wait_status)) {
    return absl::StrCat("signal ", SignalName(WTERMSIG(wait_status)));
  }
  return absl::StrCat("wait status ", wait_status);
}

int WorkerExit::ShellStatus() const {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

std::string SignalName(int signal) {
  const char* abbrev = sigabbrev_np(signal);
  if (abbrev == nullptr) return absl::StrCat("signal ", signal);
  return absl::StrCat("SIG", abbrev);
}

absl::StatusOr<std::string> ResolveProgram(const std::string& program) {
  if (program.empty()) return absl::InvalidArgumentError("no program given");
  auto runnable = [](const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
           access(path.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {
    if (runnable(program)) return program;
    return absl::NotFoundError(
        absl::StrCat(program, ": not an executable file"));
  }
  const char* path_env = std::getenv("PATH");
  // execvp's default when PATH is unset.
  const std::string search = path_env != nullptr ? path_env : "/bin:/usr/bin";
  for (absl::string_view dir : absl::StrSplit(search, ':')) {
    // An empty entry means the current folder.
    std::string candidate =
        dir.empty() ? program : absl::StrCat(dir, "/", program);
    if (runnable(candidate)) return candidate;
  }
  return absl::NotFoundError(absl::StrCat(program, ": not found in $PATH"));
}

// Copies a worker's pipe to cohortrun's stdout or stderr on a thread of its
// own, prefixing every line, and flushing each line as soon as it is whole.
class LocalWorkers::LineForwarder {
 public:
  LineForwarder(int read_fd, int out_fd, std::string prefix)
      : read_fd_(read_fd),
        out_fd_(out_fd),
        prefix_(std::move(prefix)),
        thread_([this] { Run(); }) {}

  ~LineForwarder() {
    Finish();
    close(read_fd_);
  }

  // Stops once the pipe has been quiet briefly (a worker's own children may
  // hold it open after the worker exited), and waits for the thread.
  void Finish() {
    finish_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  // How long a finishing forwarder keeps reading a pipe that is still
  // written to (by a worker's leftover children).
  static constexpr absl::Duration kDrainLimit = absl::Seconds(1);
  static constexpr size_t kMaxLine = 1 << 16;

  void Run() {
    std::string pending;
    char buf[1 << 16];
    absl::Time drain_until = absl::InfiniteFuture();
    for (;;) {
      if (finish_ && drain_until == absl::InfiniteFuture()) {
        drain_until = absl::Now() + kDrainLimit;
      }
      if (absl::Now() > drain_until) break;
      pollfd p = {read_fd_, POLLIN, 0};
      int ready = poll(&p, 1, 50);
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) break;
      if (ready == 0) {
        if (finish_) break;
        continue;
      }
      ssize_t n = read(read_fd_, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      pending.append(buf, n);
      WriteLines(pending);
    }
    if (!pending.empty()) {
      // A last line without its newline: given one, so that the next
      // rank's line starts on a line of its own.
      pending.push_back('\n');
      WriteLines(pending);
    }
  }

  // Writes the whole lines at the front of `pending` and keeps the rest. A
  // line longer than kMaxLine is cut, so that memory stays bounded.
  void WriteLines(std::string& pending) {
    size_t end = pending.rfind('\n');
    if (end == std::string::npos) {
      if (pending.size() < kMaxLine) return;
      pending.push_back('\n');
      end = pending.size() - 1;
    }
    std::string out;
    size_t start = 0;
    while (start <= end) {
      size_t newline = pending.find('\n', start);
      absl::StrAppend(
          &out, prefix_,
          absl::string_view(pending).substr(start, newline + 1 - start));
      start = newline + 1;
    }
    pending.erase(0, end + 1);
    absl::MutexLock lock(&output_mu);
    WriteAll(out_fd_, out);
  }

  const int read_fd_;
  const int out_fd_;
  const std::string prefix_;
  std::atomic<bool> finish_{false};
  std::thread thread_;  // Last: starts once the members above exist.
};

LocalWorkers::LocalWorkers(const LocalWorkersOptions& options)
    : options_(options) {}

absl::StatusOr<std::unique_ptr<LocalWorkers>> LocalWorkers::Start(
    const LocalWorkersOptions& options, std::vector<WorkerSpec> specs) {
  if (options.command.empty()) {
    return absl::InvalidArgumentError("no program given");
  }
  absl::StatusOr<std::string> path = ResolveProgram(options.command[0]);
  if (!path.ok()) return path.status();
  std::unique_ptr<LocalWorkers> workers(new LocalWorkers(options));
  workers->workers_.reserve(specs.size());
  for (WorkerSpec& spec : specs) {
    workers->workers_.push_back(Worker{std::move(spec)});
    absl::Status spawned = workers->Spawn(*path, workers->workers_.back());
    if (!spawned.ok()) {
      workers->workers_.pop_back();
      return spawned;  // The destructor kills those already started.
    }
  }
  return workers;
}

absl::Status LocalWorkers::Spawn(const std::string& path, Worker& worker) {
  // Everything the child touches is prepared before fork: between fork and
  // exec, a process with threads (gRPC's, the forwarders') may only make
  // async-signal-safe calls, so no allocation there.
  std::vector<std::string> command = options_.command;
  std::vector<char*> argv;
  for (std::string& arg : command) argv.push_back(arg.data());
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (std::string& entry : worker.spec.environment) {
    envp.push_back(entry.data());
  }
  envp.push_back(nullptr);

  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  int exec_errno_pipe[2] = {-1, -1};
  if (absl::Status s =
          OpenPipes(options_.tee, out_pipe, err_pipe, exec_errno_pipe);
      !s.ok()) {
    return s;
  }
  const int child_out = options_.tee ? out_pipe[1] : options_.stdout_fd;
  const int child_err = options_.tee ? err_pipe[1] : options_.stderr_fd;
  const pid_t parent = getpid();
  sigset_t no_signals;
  sigemptyset(&no_signals);
  struct sigaction default_action = {};
  default_action.sa_handler = SIG_DFL;

  pid_t pid = fork();
  if (pid == 0) {
    ExecChild({.path = path.c_str(),
               .argv = argv.data(),
               .envp = envp.data(),
               .parent = parent,
               .out = child_out,
               .err = child_err,
               .exec_errno = exec_errno_pipe[1],
               .no_signals = &no_signals,
               .default_action = &default_action});
  }
  int fork_errno = errno;
  close(exec_errno_pipe[1]);
  if (options_.tee) {
    close(out_pipe[1]);
    close(err_pipe[1]);
  }
  if (pid < 0) {
    close(exec_errno_pipe[0]);
    if (options_.tee) {
      close(out_pipe[0]);
      close(err_pipe[0]);
    }
    return absl::ResourceExhaustedError(
        absl::StrCat("fork: ", strerror(fork_errno)));
  }
  // Also here, so that a signal sent right after Start reaches the group
  // even if the child has not run yet.
  setpgid(pid, pid);
  worker.pid = pid;
  if (options_.tee) {
    std::string prefix = absl::StrCat("[rank ", worker.spec.rank, "] ");
    forwarders_.push_back(std::make_unique<LineForwarder>(
        out_pipe[0], options_.stdout_fd, prefix));
    forwarders_.push_back(std::make_unique<LineForwarder>(
        err_pipe[0], options_.stderr_fd, prefix));
  }
  const int exec_errno = ReadExecErrno(exec_errno_pipe[0]);
  if (exec_errno != 0) {
    Reap(worker, /*block=*/true);
    worker.returned = true;
    return absl::FailedPreconditionError(
        absl::StrCat("cannot run ", path, ": ", strerror(exec_errno)));
  }
  return absl::OkStatus();
}

LocalWorkers::~LocalWorkers() {
  if (!AllExited()) {
    SignalAll(SIGKILL);
    for (Worker& worker : workers_) Reap(worker, /*block=*/true);
  }
  forwarders_.clear();
}

bool LocalWorkers::Reap(Worker& worker, bool block) {
  if (worker.reaped) return true;
  int status = 0;
  pid_t got;
  do {
    got = waitpid(worker.pid, &status, block ? 0 : WNOHANG);
  } while (got < 0 && errno == EINTR);
  if (got == 0) return false;
  worker.reaped = true;
  // ECHILD: someone else reaped it; all that is known is that it is gone.
  worker.wait_status = got == worker.pid ? status : (255 << 8);
  return true;
}

void LocalWorkers::SignalAll(int signal) {
  for (Worker& worker : workers_) {
    if (worker.pid <= 0) continue;  // kill(-1) would signal everything.
    // The whole group, also of workers already reaped: their children may
    // still run (and hold GPU memory) after the worker itself exited.
    if (kill(-worker.pid, signal) != 0 && !worker.reaped) {
      kill(worker.pid, signal);
    }
  }
}

std::vector<WorkerExit> LocalWorkers::TakeNewExits() {
  std::vector<WorkerExit> exits;
  for (Worker& worker : workers_) {
    if (!worker.reaped || worker.returned) continue;
    worker.returned = true;
    exits.push_back(WorkerExit{worker.spec.rank, worker.spec.local_rank,
                               worker.wait_status});
  }
  return exits;
}

void LocalWorkers::FinishOutputIfDone() {
  if (!AllExited()) return;
  for (auto& forwarder : forwarders_) forwarder->Finish();
}

std::vector<WorkerExit> LocalWorkers::Poll() {
  for (Worker& worker : workers_) Reap(worker, /*block=*/false);
  FinishOutputIfDone();
  return TakeNewExits();
}

bool LocalWorkers::AllExited() const {
  for (const Worker& worker : workers_) {
    if (!worker.reaped) return false;
  }
  return true;
}

std::vector<pid_t> LocalWorkers::pids() const {
  std::vector<pid_t> pids;
  for (const Worker& worker : workers_) pids.push_back(worker.pid);
  return pids;
}

std::vector<WorkerExit> LocalWorkers::Stop(int signal, absl::Duration grace) {
  SignalAll(signal);
  const absl::Time kill_at = absl::Now() + grace;
  for (;;) {
    bool all_reaped = true;
    for (Worker& worker : workers_) all_reaped &= Reap(worker, false);
    if (all_reaped || absl::Now() >= kill_at) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (!AllExited()) {
    SignalAll(SIGKILL);
    for (Worker& worker : workers_) Reap(worker, /*block=*/true);
  }
  FinishOutputIfDone();
  return TakeNewExits();
}

}  // namespace cohort

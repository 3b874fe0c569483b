#include "tests/testing/cohortd_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace cohort::testing {

absl::StatusOr<CohortdProcess> CohortdProcess::Start(
    std::vector<std::string> args, int port) {
  bool tcpstore = true;
  bool tcpstore_flag = false;
  for (const std::string& a : args) {
    if (absl::StartsWith(a, "--tcpstore_listen=")) {
      tcpstore_flag = true;
      tcpstore = a != "--tcpstore_listen=";
    }
  }
  // Never the default port 29400: tests run side by side.
  if (!tcpstore_flag) args.push_back("--tcpstore_listen=127.0.0.1:0");
  args.insert(args.begin(), absl::StrCat("--listen=127.0.0.1:", port));
  args.insert(args.begin(), "server/cohortd");
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return absl::InternalError("pipe failed");
  // Built before fork: the child of a threaded parent must not allocate.
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    dup2(pipe_fds[1], STDERR_FILENO);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  CohortdProcess process;
  process.pid_ = pid;
  process.stderr_fd_ = pipe_fds[0];
  fcntl(process.stderr_fd_, F_SETFL, O_NONBLOCK);

  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  const std::string kMarker = "serving cohort.v1.Store on ";
  while (absl::Now() < give_up) {
    std::string log = process.Log();
    size_t at = log.find(kMarker);
    if (at != std::string::npos) {
      size_t colon = log.find(':', at + kMarker.size());
      size_t end = log.find(';', colon);
      if (colon != std::string::npos && end != std::string::npos &&
          absl::SimpleAtoi(log.substr(colon + 1, end - colon - 1),
                           &process.port_)) {
        if (!tcpstore) return process;
        const std::string kTcpStore = "serving the TCPStore protocol on ";
        size_t t = log.find(kTcpStore, end);
        size_t t_colon = t == std::string::npos
                             ? std::string::npos
                             : log.find(':', t + kTcpStore.size());
        size_t t_end = t_colon == std::string::npos ? std::string::npos
                                                    : log.find(' ', t_colon);
        if (t_end != std::string::npos &&
            absl::SimpleAtoi(log.substr(t_colon + 1, t_end - t_colon - 1),
                             &process.tcpstore_port_)) {
          return process;
        }
      }
    }
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      process.pid_ = -1;
      return absl::InternalError(
          absl::StrCat("cohortd exited before serving:\n", log));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("cohortd did not start in 30 s:\n", process.Log()));
}

CohortdProcess::CohortdProcess(CohortdProcess&& other) noexcept {
  *this = std::move(other);
}

CohortdProcess& CohortdProcess::operator=(CohortdProcess&& other) noexcept {
  std::swap(pid_, other.pid_);
  std::swap(port_, other.port_);
  std::swap(tcpstore_port_, other.tcpstore_port_);
  std::swap(stderr_fd_, other.stderr_fd_);
  std::swap(log_, other.log_);
  return *this;
}

CohortdProcess::~CohortdProcess() {
  if (pid_ > 0) Stop(SIGKILL);
  if (stderr_fd_ >= 0) close(stderr_fd_);
}

std::string CohortdProcess::address() const {
  return absl::StrCat("127.0.0.1:", port_);
}

int CohortdProcess::Stop(int signal) {
  if (pid_ <= 0) return -1;
  kill(pid_, signal);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  Log();
  return status;
}

int CohortdProcess::ThreadCount() const {
  std::ifstream in(absl::StrCat("/proc/", pid_, "/status"));
  std::string line;
  int threads = -1;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "Threads:")) {
      absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(8)), &threads);
    }
  }
  return threads;
}

std::string CohortdProcess::Log() {
  char buf[4096];
  for (;;) {
    ssize_t n = read(stderr_fd_, buf, sizeof(buf));
    if (n <= 0) break;
    log_.append(buf, n);
  }
  return log_;
}

}  // namespace cohort::testing

#include "worker/launch/local_workers.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

using ::testing::ElementsAre;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// A file the workers write to, standing in for cohortrun's stdout.
class OutputFile {
 public:
  explicit OutputFile(const std::string& name)
      : path_(absl::StrCat(::testing::TempDir(), "/", name)) {
    fd_ = open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  }
  ~OutputFile() { close(fd_); }
  int fd() const { return fd_; }
  std::string Contents() const { return ReadFile(path_); }

 private:
  std::string path_;
  int fd_;
};

WorkerSpec Spec(int rank, int local_rank, std::vector<std::string> env = {}) {
  return WorkerSpec{rank, local_rank, std::move(env)};
}

LocalWorkersOptions Shell(const std::string& script) {
  LocalWorkersOptions options;
  options.command = {"sh", "-c", script};
  return options;
}

// Polls until every worker exited (or 10 s), returning all exits.
std::vector<WorkerExit> WaitAll(LocalWorkers& workers) {
  std::vector<WorkerExit> all;
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!workers.AllExited() && absl::Now() < give_up) {
    for (const WorkerExit& exit : workers.Poll()) all.push_back(exit);
    absl::SleepFor(absl::Milliseconds(10));
  }
  for (const WorkerExit& exit : workers.Poll()) all.push_back(exit);
  return all;
}

std::vector<std::string> Describe(const std::vector<WorkerExit>& exits) {
  std::vector<std::string> out;
  for (const WorkerExit& exit : exits) {
    out.push_back(absl::StrCat("rank ", exit.rank, ": ", exit.Describe()));
  }
  return out;
}

TEST(LocalWorkersTest, ReportsEachExitOnce) {
  auto workers = LocalWorkers::Start(
      Shell("exit $CODE"), {Spec(4, 0, {"CODE=0"}), Spec(5, 1, {"CODE=3"})});
  ASSERT_TRUE(workers.ok()) << workers.status();
  std::vector<WorkerExit> exits = WaitAll(**workers);
  EXPECT_THAT(Describe(exits), UnorderedElementsAre("rank 4: exit code 0",
                                                    "rank 5: exit code 3"));
  for (const WorkerExit& exit : exits) {
    EXPECT_EQ(exit.ok(), exit.rank == 4);
    EXPECT_EQ(exit.ShellStatus(), exit.rank == 4 ? 0 : 3);
    EXPECT_EQ(exit.local_rank, exit.rank - 4);
  }
  EXPECT_TRUE((*workers)->Poll().empty());
  EXPECT_TRUE((*workers)->AllExited());
}

TEST(LocalWorkersTest, WorkersGetExactlyTheirEnvironment) {
  OutputFile out("env.txt");
  LocalWorkersOptions options = Shell("echo \"$RANK:${HOME-unset}\"");
  options.stdout_fd = out.fd();
  auto workers = LocalWorkers::Start(options, {Spec(0, 0, {"RANK=7"})});
  ASSERT_TRUE(workers.ok()) << workers.status();
  WaitAll(**workers);
  EXPECT_EQ(out.Contents(), "7:unset\n");
}

TEST(LocalWorkersTest, OutputPassesThroughUnchangedWithoutTee) {
  OutputFile out("plain.txt");
  LocalWorkersOptions options = Shell("printf 'a\\nb'");
  options.stdout_fd = out.fd();
  auto workers = LocalWorkers::Start(options, {Spec(3, 0)});
  ASSERT_TRUE(workers.ok()) << workers.status();
  WaitAll(**workers);
  EXPECT_EQ(out.Contents(), "a\nb");
}

TEST(LocalWorkersTest, TeePrefixesEveryLineWithTheRank) {
  OutputFile out("tee_out.txt");
  OutputFile err("tee_err.txt");
  LocalWorkersOptions options =
      Shell("printf 'one\\ntwo\\n'; echo oops >&2; printf partial");
  options.tee = true;
  options.stdout_fd = out.fd();
  options.stderr_fd = err.fd();
  auto workers = LocalWorkers::Start(options, {Spec(3, 0), Spec(4, 1)});
  ASSERT_TRUE(workers.ok()) << workers.status();
  WaitAll(**workers);
  // Lines of the two ranks may interleave, but never within a line.
  std::vector<std::string> lines = absl::StrSplit(out.Contents(), '\n');
  std::sort(lines.begin(), lines.end());
  EXPECT_THAT(
      lines, ElementsAre("", "[rank 3] one", "[rank 3] partial", "[rank 3] two",
                         "[rank 4] one", "[rank 4] partial", "[rank 4] two"));
  std::vector<std::string> err_lines = absl::StrSplit(err.Contents(), '\n');
  std::sort(err_lines.begin(), err_lines.end());
  EXPECT_THAT(err_lines, ElementsAre("", "[rank 3] oops", "[rank 4] oops"));
}

TEST(LocalWorkersTest, StopSendsTheSignal) {
  auto workers = LocalWorkers::Start(Shell("exec sleep 30"), {Spec(0, 0)});
  ASSERT_TRUE(workers.ok()) << workers.status();
  std::vector<WorkerExit> exits = (*workers)->Stop(SIGTERM, absl::Seconds(10));
  EXPECT_THAT(Describe(exits), ElementsAre("rank 0: signal SIGTERM"));
  EXPECT_EQ(exits[0].ShellStatus(), 128 + SIGTERM);
}

TEST(LocalWorkersTest, StopEscalatesToSigkillAfterTheGrace) {
  const std::string ready = absl::StrCat(::testing::TempDir(), "/trapped");
  unlink(ready.c_str());
  // Ignores SIGTERM and would run forever: only the SIGKILL after the
  // grace ends it (else Stop, and the test, never return).
  auto workers =
      LocalWorkers::Start(Shell(absl::StrCat("trap '' TERM; echo set > ", ready,
                                             "; exec sleep infinity")),
                          {Spec(0, 0)});
  ASSERT_TRUE(workers.ok()) << workers.status();
  // The trap is set before the file is written.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (ReadFile(ready).empty() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(ReadFile(ready), "set\n") << "the worker never set its trap";
  std::vector<WorkerExit> exits =
      (*workers)->Stop(SIGTERM, absl::Milliseconds(300));
  EXPECT_THAT(Describe(exits), ElementsAre("rank 0: signal SIGKILL"));
}

TEST(LocalWorkersTest, StopReachesTheWorkersChildren) {
  const std::string pid_file = absl::StrCat(::testing::TempDir(), "/child");
  unlink(pid_file.c_str());
  auto workers = LocalWorkers::Start(
      Shell(absl::StrCat("sleep 30 & echo $! > ", pid_file, "; wait")),
      {Spec(0, 0)});
  ASSERT_TRUE(workers.ok()) << workers.status();
  int child = 0;
  for (int i = 0; i < 500 && child == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFile(pid_file)), &child);
  }
  ASSERT_GT(child, 0);
  (*workers)->Stop(SIGTERM, absl::Seconds(5));
  // The orphan is reaped by init (or a subreaper) once it dies.
  bool gone = false;
  for (int i = 0; i < 500 && !gone; ++i) {
    gone = kill(child, 0) != 0;
    std::string stat = ReadFile(absl::StrCat("/proc/", child, "/stat"));
    gone |= stat.find(") Z ") != std::string::npos;
    if (!gone) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(gone) << "pid " << child << " survived";
}

TEST(LocalWorkersTest, DestructionKillsRunningWorkers) {
  pid_t pid = -1;
  {
    auto workers = LocalWorkers::Start(Shell("exec sleep 30"), {Spec(0, 0)});
    ASSERT_TRUE(workers.ok()) << workers.status();
    pid = (*workers)->pids()[0];
  }
  EXPECT_NE(kill(pid, 0), 0);
}

TEST(LocalWorkersTest, StartFailsForAProgramThatCannotRun) {
  LocalWorkersOptions missing;
  missing.command = {"no-such-program-here"};
  auto workers = LocalWorkers::Start(missing, {Spec(0, 0)});
  EXPECT_TRUE(absl::IsNotFound(workers.status())) << workers.status();
  EXPECT_THAT(std::string(workers.status().message()),
              HasSubstr("no-such-program-here: not found in $PATH"));

  LocalWorkersOptions not_executable;
  not_executable.command = {"/etc/hostname"};
  workers = LocalWorkers::Start(not_executable, {Spec(0, 0)});
  EXPECT_FALSE(workers.ok());
}

TEST(LocalWorkersTest, ResolveProgramSearchesPath) {
  absl::StatusOr<std::string> sh = ResolveProgram("sh");
  ASSERT_TRUE(sh.ok()) << sh.status();
  EXPECT_THAT(*sh, EndsWith("/sh"));
  EXPECT_EQ(*ResolveProgram("/bin/sh"), "/bin/sh");
}

TEST(LocalWorkersTest, SignalNames) {
  EXPECT_EQ(SignalName(SIGTERM), "SIGTERM");
  EXPECT_EQ(SignalName(SIGSEGV), "SIGSEGV");
}

}  // namespace
}  // namespace cohort

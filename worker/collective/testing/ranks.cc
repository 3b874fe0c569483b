#include "worker/collective/testing/ranks.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/file_store.h"
#include "gtest/gtest.h"
#include "worker/collective/init/backend_factory.h"

namespace cohort::testing {
namespace {

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

absl::Status RunRank(const std::string& store_path, int rank, int world,
                     const RankMain& main) {
  absl::StatusOr<std::unique_ptr<FileStore>> store =
      FileStore::Open(store_path);
  if (!store.ok()) return store.status();
  InitOptions options;
  options.group.timeout = absl::Seconds(30);
  options.gloo.store_prefix = "ranks";
  options.gloo.bind_address = "127.0.0.1";
  absl::StatusOr<std::unique_ptr<ProcessGroup>> group =
      CreateProcessGroup("gloo", std::move(*store), rank, world, options);
  if (!group.ok()) return group.status();
  return main(std::shared_ptr<ProcessGroup>(std::move(*group)));
}

}  // namespace

std::string TempPath(const std::string& name) {
  static std::atomic<int> counter{0};
  return absl::StrCat(TempDir(), "/", name, ".", getpid(), ".", counter++);
}

void RunRanks(int world, const RankMain& main, absl::Duration limit) {
  const std::string store_path = TempPath("ranks_store");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    std::fflush(nullptr);
    pid_t pid = fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) {
      absl::Status status = RunRank(store_path, rank, world, main);
      if (!status.ok()) {
        std::fprintf(stderr, "rank %d of %d failed: %s\n", rank, world,
                     status.ToString().c_str());
      }
      std::fflush(nullptr);
      _exit(status.ok() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  const absl::Time give_up = absl::Now() + limit;
  for (int rank = 0; rank < world; ++rank) {
    int status = 0;
    while (waitpid(pids[rank], &status, WNOHANG) == 0) {
      if (absl::Now() > give_up) {
        for (pid_t pid : pids) kill(pid, SIGKILL);
        waitpid(pids[rank], &status, 0);
        ADD_FAILURE() << "rank " << rank << " of " << world
                      << " still running after " << limit << "; killed";
        break;
      }
      absl::SleepFor(absl::Milliseconds(2));
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << " of " << world << " failed (wait status "
        << status << "; its error is on stderr)";
  }
  std::remove(store_path.c_str());
}

absl::Status WriteFloats(const std::string& path,
                         const std::vector<float>& values) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(values.data()),
            static_cast<std::streamsize>(values.size() * sizeof(float)));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ReadFloats(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  const std::streamsize bytes = in.tellg();
  std::vector<float> values(static_cast<size_t>(bytes) / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(values.data()), bytes);
  if (!in) return absl::DataLossError(absl::StrCat("short read of ", path));
  return values;
}

}  // namespace cohort::testing

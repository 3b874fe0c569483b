// Test support for the shared-memory transport: forks the local ranks of a
// group, rendezvousing through a FileStore in the test's temporary
// directory (no cohortd), and reads what they left in /dev/shm.
#ifndef COHORT_WORKER_COLLECTIVE_GLOO_SHM_LOCAL_RANKS_H_
#define COHORT_WORKER_COLLECTIVE_GLOO_SHM_LOCAL_RANKS_H_

#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/file_store.h"
#include "gtest/gtest.h"

namespace cohort::testing {

#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  } while (false)

inline std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// The /dev/shm names a process with `pid` created.
inline std::vector<std::string> NamesOf(pid_t pid) {
  std::vector<std::string> names;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  const std::string prefix = absl::StrCat("cohort.", pid, ".");
  while (dirent* entry = readdir(dir)) {
    if (absl::StartsWith(entry->d_name, prefix)) names.push_back(entry->d_name);
  }
  closedir(dir);
  return names;
}

struct Local {
  int rank;
  int size;
  std::shared_ptr<Store> store;
};
using LocalMain = std::function<absl::Status(const Local&)>;

// Forks `size` local ranks (or only those in `run`, when given) and returns
// their wait statuses. A rank that fails prints why and exits 1.
inline std::vector<int> Fork(int size, const LocalMain& main,
                             std::vector<int> run = {},
                             std::vector<pid_t>* forked = nullptr) {
  static int calls = 0;
  const std::string path =
      absl::StrCat(TempDir(), "/store.", getpid(), ".", calls++);
  if (run.empty()) {
    run.resize(size);
    std::iota(run.begin(), run.end(), 0);
  }
  std::vector<pid_t> pids;
  for (int rank : run) {
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      absl::Status status = [&]() -> absl::Status {
        absl::StatusOr<std::unique_ptr<FileStore>> store =
            FileStore::Open(path);
        if (!store.ok()) return store.status();
        return main(Local{rank, size, std::move(*store)});
      }();
      if (!status.ok()) {
        std::fprintf(stderr, "local rank %d failed: %s\n", rank,
                     status.ToString().c_str());
      }
      std::fflush(nullptr);
      _exit(status.ok() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  if (forked != nullptr) *forked = pids;
  std::vector<int> statuses;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    statuses.push_back(status);
  }
  return statuses;
}

inline void ExpectAllOk(const std::vector<int>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(WIFEXITED(statuses[r]) && WEXITSTATUS(statuses[r]) == 0)
        << "local rank " << r << " (wait status " << statuses[r] << ")";
  }
}

}  // namespace cohort::testing

#endif  // COHORT_WORKER_COLLECTIVE_GLOO_SHM_LOCAL_RANKS_H_

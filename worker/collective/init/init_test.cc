// InitProcessGroup with every init method, ranks as forked processes.
#include "worker/collective/init/init.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/tcpstore_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cohortd_process.h"

namespace cohort {
namespace {

using ::testing::HasSubstr;

// Runs `body(rank)` in `world` forked processes; each exit status is 0 when
// the rank's body returned true. Children never return into gtest.
std::vector<int> RunRanks(int world, const std::function<bool(int)>& body) {
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    pid_t pid = fork();
    if (pid == 0) _exit(body(rank) ? 0 : 1);
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128);
  }
  return codes;
}

// Each rank contributes rank + 1; the sum is world * (world + 1) / 2.
bool SumRanks(ProcessGroup& pg) {
  float value = pg.rank() + 1;
  std::shared_ptr<Work> work =
      pg.AllReduce(BufferView::Of(&value, 1), ReduceOp::kSum);
  absl::Status s = work->Wait(absl::Seconds(30));
  const float want = pg.size() * (pg.size() + 1) / 2.0f;
  if (!s.ok() || value != want) {
    std::fprintf(stderr, "rank %d: %s, sum %f, want %f\n", pg.rank(),
                 s.ToString().c_str(), value, want);
    return false;
  }
  return true;
}

InitOptions Quick() {
  InitOptions options;
  options.group.timeout = absl::Seconds(20);
  options.gloo.bind_address = "127.0.0.1";
  return options;
}

TEST(InitTest, FileInitNeedsNoCoordinatorAndCleansUp) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/pg-file");
  std::filesystem::remove(path);
  for (int world : {1, 3}) {
    std::vector<int> codes = RunRanks(world, [&](int rank) {
      auto pg =
          InitProcessGroup("gloo", "file://" + path, rank, world, Quick());
      return pg.ok() && SumRanks(**pg);
    });
    EXPECT_THAT(codes, ::testing::Each(0)) << "world " << world;
    EXPECT_FALSE(std::filesystem::exists(path)) << "world " << world;
  }
}

class WithCohortd : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = testing::CohortdProcess::Start({"--engine=memory"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::make_unique<testing::CohortdProcess>(std::move(*server));
  }
  std::unique_ptr<testing::CohortdProcess> server_;
};

TEST_F(WithCohortd, EnvInitReadsWhatCohortrunSets) {
  const std::string address = server_->address();
  std::vector<int> codes = RunRanks(2, [&](int rank) {
    setenv("RANK", absl::StrCat(rank).c_str(), 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("COHORT_STORE_PREFIX", "runs/job/0", 1);
    // MASTER_ADDR/MASTER_PORT is the fallback when COHORT_ADDR is unset.
    if (rank == 0) {
      setenv("COHORT_ADDR", address.c_str(), 1);
    } else {
      unsetenv("COHORT_ADDR");
      const size_t colon = address.rfind(':');
      setenv("MASTER_ADDR", address.substr(0, colon).c_str(), 1);
      setenv("MASTER_PORT", address.substr(colon + 1).c_str(), 1);
    }
    auto pg = InitProcessGroup("gloo", "env://", -1, -1, Quick());
    return pg.ok() && SumRanks(**pg);
  });
  EXPECT_THAT(codes, ::testing::Each(0));
}

TEST_F(WithCohortd, TcpInitTwiceInOneStoreGetsFreshKeys) {
  const std::string url = absl::StrCat("tcp://", server_->address(), "/job7");
  std::vector<int> codes = RunRanks(3, [&](int rank) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto pg = InitProcessGroup("gloo", url, rank, 3, Quick());
      if (!pg.ok() || !SumRanks(**pg)) return false;
    }
    auto pg =
        InitProcessGroup("gloo", absl::StrCat("cohort://", server_->address()),
                         rank, 3, Quick());
    return pg.ok() && SumRanks(**pg);
  });
  EXPECT_THAT(codes, ::testing::Each(0));
}

// Bootstraps through Debian's own PyTorch 1.13 TCPStore server.
TEST(InitTest, TcpStoreInitThroughTorchsServer) {
  FILE* server = popen(
      "exec /usr/bin/python3 -c '\n"
      "import os, sys, time\n"
      "try:\n"
      "    import torch.distributed as dist\n"
      "except Exception as e:\n"
      "    print(\"NOTORCH\", e, flush=True)\n"
      "    sys.exit(3)\n"
      "s = dist.TCPStore(\"127.0.0.1\", 0, is_master=True,\n"
      "                  wait_for_workers=False)\n"
      "print(s.port, os.getpid(), flush=True)\n"
      "time.sleep(600)\n'",
      "r");
  ASSERT_NE(server, nullptr);
  char line[256] = {0};
  const bool got_line = fgets(line, sizeof(line), server) != nullptr;
  std::vector<std::string> fields = absl::StrSplit(line, ' ');
  int port = 0, pid = 0;
  if (!got_line || fields.size() != 2 || !absl::SimpleAtoi(fields[0], &port) ||
      !absl::SimpleAtoi(fields[1], &pid)) {
    pclose(server);
    FAIL() << "no torch TCPStore server (got '" << line
           << "'): /usr/bin/python3 must import torch; run tools/setup.sh";
  }
  const std::string address = absl::StrCat("127.0.0.1:", port);
  std::vector<int> codes = RunRanks(2, [&](int rank) {
    auto pg = InitProcessGroup("gloo", "tcpstore://" + address + "/job3", rank,
                               2, Quick());
    if (!pg.ok()) std::fprintf(stderr, "%s\n", pg.status().ToString().c_str());
    return pg.ok() && SumRanks(**pg);
  });
  EXPECT_THAT(codes, ::testing::Each(0));
  // The keys are where a torch client of the same server finds them.
  auto store = TcpStoreClient::Connect(
      {.address = address, .dialect = TcpStoreDialect::kTorch113});
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Get("/job3/pg/created", absl::Seconds(1)).value_or("?"),
            "2");
  kill(pid, SIGKILL);
  pclose(server);
}

TEST(InitTest, BadInitIsAClearError) {
  auto expect_invalid = [](absl::StatusOr<std::unique_ptr<ProcessGroup>> pg,
                           absl::string_view needle) {
    EXPECT_EQ(pg.status().code(), absl::StatusCode::kInvalidArgument)
        << pg.status();
    EXPECT_THAT(pg.status().message(), HasSubstr(needle));
  };
  expect_invalid(InitProcessGroup("mpi", "env://"), "unknown backend 'mpi'");
  expect_invalid(InitProcessGroup("gloo", "redis://x:1", 0, 1),
                 "unknown init_method");
  expect_invalid(InitProcessGroup("gloo", "file://relative", 0, 1),
                 "absolute path");
  expect_invalid(InitProcessGroup("gloo", "tcp://127.0.0.1:1"),
                 "give rank and world_size");
  expect_invalid(
      InitProcessGroup("gloo", "tcpstore://127.0.0.1:1?dialect=3", 0, 1),
      "unknown query 'dialect=3'");
  unsetenv("RANK");
  expect_invalid(InitProcessGroup("gloo", "env://"), "RANK");
  setenv("RANK", "x", 1);
  expect_invalid(InitProcessGroup("gloo", "env://"), "not an integer");
  const std::string path = absl::StrCat(::testing::TempDir(), "/pg-bad");
  expect_invalid(InitProcessGroup("gloo", "file://" + path, 2, 2), "rank 2");
}

// "nccl" goes through the same init methods; without a GPU (CI never has
// one) the group's creation says so.
TEST(InitTest, NcclWithoutAGpuSaysNoCudaDeviceVisible) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/pg-nccl");
  absl::StatusOr<std::unique_ptr<ProcessGroup>> pg =
      InitProcessGroup("nccl", "file://" + path, 0, 1);
  if (pg.ok()) GTEST_SKIP() << "a GPU is visible: the group was created";
  EXPECT_EQ(pg.status().code(), absl::StatusCode::kFailedPrecondition)
      << pg.status();
  EXPECT_THAT(pg.status().message(), HasSubstr("no CUDA device visible"));
}

}  // namespace
}  // namespace cohort

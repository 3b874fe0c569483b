// kill -9 of a rank at a random point of a save, 20 trials: whatever was
// in flight (a file half written, fsync, the report, rank 0 between
// metadata.json and the commit), the latest committed checkpoint always
// opens and verifies, every listed checkpoint does, and a step whose save
// was cut short is never listed.
//
// Each trial forks 3 ranks that save steps 1, 2, 3, ... back to back
// (synchronously, 64 KiB per rank per step) over one FileStore, lets them
// run for a random 0-60 ms, SIGKILLs a random rank and then the others
// (a rank that outlives its peer only waits for a commit that never comes).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/file_store.h"
#include "gtest/gtest.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/collective/testing/ranks.h"

namespace cohort {
namespace {

constexpr int kWorld = 3;
constexpr size_t kElements = 16384;  // 64 KiB of f32 per rank.

[[noreturn]] void RankMain(const std::string& store_path,
                           const std::string& dir, int rank) {
  auto store = FileStore::Open(store_path);
  if (!store.ok()) _exit(3);
  CheckpointCatalog catalog(store->get(), CheckpointPrefix("trials"));
  auto writer = CheckpointWriter::Create({.dir = dir,
                                          .rank = rank,
                                          .world_size = kWorld,
                                          .catalog = &catalog,
                                          .commit_timeout = absl::Seconds(30)});
  if (!writer.ok()) _exit(4);
  std::vector<float> shard(kElements);
  for (int64_t step = 1;; ++step) {
    for (size_t i = 0; i < shard.size(); ++i) shard[i] = step * 1000.0f + i;
    const ElementRange r = EvenShard(kElements * kWorld, rank, kWorld);
    absl::Status s = (*writer)->Save(step, {{"w", {kElements * kWorld}, r.start, shard}});
    if (!s.ok()) _exit(5);
  }
}

TEST(CheckpointKillTrialsTest, ALatestCheckpointAlwaysLoadsAndVerifies) {
  std::mt19937 random(20261127);
  int committed_total = 0;
  for (int trial = 0; trial < 20; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    const std::string store_path = testing::TempPath("store");
    const std::string dir = testing::TempPath("ckpt");
    std::vector<pid_t> pids;
    for (int rank = 0; rank < kWorld; ++rank) {
      const pid_t pid = fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) RankMain(store_path, dir, rank);
      pids.push_back(pid);
    }
    absl::SleepFor(absl::Milliseconds(random() % 61));
    const int victim = static_cast<int>(random() % kWorld);
    kill(pids[victim], SIGKILL);
    // The survivors block in the save the victim never finishes.
    absl::SleepFor(absl::Milliseconds(random() % 20));
    for (pid_t pid : pids) kill(pid, SIGKILL);
    for (pid_t pid : pids) {
      int status = 0;
      waitpid(pid, &status, 0);
      EXPECT_TRUE(WIFSIGNALED(status)) << "a rank exited by itself: "
                                       << WEXITSTATUS(status);
    }
    auto store = FileStore::Open(store_path);
    ASSERT_TRUE(store.ok()) << store.status();
    CheckpointCatalog catalog(store->get(), CheckpointPrefix("trials"));
    auto list = catalog.List();
    ASSERT_TRUE(list.ok()) << list.status();
    auto latest = CheckpointReader::OpenLatest(catalog);
    ASSERT_TRUE(latest.ok()) << latest.status();
    if (list->empty()) {
      EXPECT_EQ(*latest, nullptr);
      continue;
    }
    ASSERT_NE(*latest, nullptr);
    EXPECT_EQ((*latest)->step(), list->back().step());
    committed_total += list->size();
    for (const v1::CheckpointRecord& record : *list) {
      auto reader = CheckpointReader::Open(record.path());
      ASSERT_TRUE(reader.ok()) << reader.status();
      ASSERT_TRUE((*reader)->Verify().ok()) << record.path();
      // Its contents are that step's: the shards of every rank.
      std::vector<float> all(kElements * kWorld);
      ASSERT_TRUE((*reader)->Read("w", 0, absl::MakeSpan(all)).ok());
      for (int rank = 0; rank < kWorld; ++rank) {
        EXPECT_EQ(all[rank * kElements + 7], record.step() * 1000.0f + 7);
      }
    }
    // The step after the latest was never committed, whatever is on disk.
    EXPECT_FALSE(*catalog.IsCommitted(list->back().step() + 1));
  }
  // The trials did reach commits (the kill is not always before the first).
  std::printf("20 trials: %d checkpoints committed, every one verified\n",
              committed_total);
  EXPECT_GT(committed_total, 0);
}

}  // namespace
}  // namespace cohort

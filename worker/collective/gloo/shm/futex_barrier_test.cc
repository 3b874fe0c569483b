// FutexBarrier: ranks as threads of one process over words on the heap (a
// futex works the same on private and shared memory), and a forked child
// standing in for a peer that dies.
#include "worker/collective/gloo/shm/futex_barrier.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

using ::testing::HasSubstr;

// The words of `n` ranks, each with this process's pid.
struct Words {
  explicit Words(int n) : words(new BarrierWords[n]()), n(n) {
    for (int q = 0; q < n; ++q) words[q].pid.store(getpid());
  }
  std::vector<BarrierWords*> All() {
    std::vector<BarrierWords*> all;
    for (int q = 0; q < n; ++q) all.push_back(&words[q]);
    return all;
  }
  std::unique_ptr<BarrierWords[]> words;
  int n;
};

absl::Time Later() { return absl::Now() + absl::Seconds(30); }

// Every rank writes its step into a shared array before each barrier and
// reads every other rank's after it: a barrier orders them, so each sees
// the step it is at, never an older one.
void StepInLockstep(absl::Duration spin) {
  constexpr int kRanks = 4, kSteps = 300;
  Words words(kRanks);
  std::atomic<int> step[kRanks] = {};
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      FutexBarrierOptions options;
      options.spin = spin;
      FutexBarrier barrier(r, words.All(), options);
      barrier.NotePeers();
      for (int s = 1; s <= kSteps; ++s) {
        step[r].store(s);
        if (!barrier.Arrive(Later()).ok()) ++wrong;
        for (int q = 0; q < kRanks; ++q) {
          if (step[q].load() < s) ++wrong;
        }
        // Nobody writes step s + 1 before everyone has read step s.
        if (!barrier.Arrive(Later()).ok()) ++wrong;
      }
      if (barrier.generation() != 2 * kSteps) ++wrong;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(FutexBarrier, OrdersEveryStepWhenSpinning) {
  StepInLockstep(absl::Microseconds(50));
}

TEST(FutexBarrier, OrdersEveryStepWhenSleepingAtOnce) {
  StepInLockstep(absl::ZeroDuration());
}

TEST(FutexBarrier, AStuckPeerTimesOutNamingIt) {
  Words words(3);
  FutexBarrierOptions options;
  options.spin = absl::ZeroDuration();
  options.timeout = absl::Milliseconds(100);
  options.group_ranks = {4, 5, 6};
  // Rank 1 arrives (its count is ahead); rank 2 never does.
  words.words[1].arrived.store(1);
  FutexBarrier barrier(0, words.All(), options);
  barrier.NotePeers();
  absl::Status status = barrier.Arrive(absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(status.message(),
              HasSubstr("rank(s) 6 did not reach the op's step 1 within "
                        "100ms (shared memory)"));
}

TEST(FutexBarrier, AFailedGroupEndsTheWaitWithItsStatus) {
  Words words(2);
  std::atomic<bool> failed{false};
  FutexBarrierOptions options;
  options.failed = [&] {
    return failed.load() ? absl::UnavailableError("the group failed")
                         : absl::OkStatus();
  };
  FutexBarrier barrier(0, words.All(), options);
  barrier.NotePeers();
  std::thread fail([&] {
    absl::SleepFor(absl::Milliseconds(50));
    failed.store(true);
  });
  // Long before the deadline, within a slice of the failure.
  absl::Status status = barrier.Arrive(absl::Now() + absl::Minutes(10));
  fail.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr("the group failed"));
}

TEST(FutexBarrier, APeerWhoseProcessExitedIsNamed) {
  const pid_t peer = fork();
  if (peer == 0) {
    pause();  // Until killed.
    _exit(0);
  }
  Words words(2);
  words.words[1].pid.store(peer);
  FutexBarrierOptions options;
  options.group_ranks = {0, 7};
  FutexBarrier barrier(0, words.All(), options);
  barrier.NotePeers();  // The peer is alive, so its exit can be seen.
  kill(peer, SIGKILL);
  waitpid(peer, nullptr, 0);
  absl::Status status = barrier.Arrive(absl::Now() + absl::Minutes(10));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(),
              HasSubstr(absl::StrCat("rank 7 (pid ", peer,
                                     ", on this host) exited during the op")));
}

TEST(FutexBarrier, ProcessGoneSeesExitedAndZombieProcesses) {
  EXPECT_FALSE(ProcessGone(getpid()));
  EXPECT_FALSE(ProcessGone(0));
  const pid_t child = fork();
  if (child == 0) _exit(0);
  // A zombie until reaped, then gone.
  for (int i = 0; i < 1000 && !ProcessGone(child); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(ProcessGone(child));
  waitpid(child, nullptr, 0);
  EXPECT_TRUE(ProcessGone(child));
}

}  // namespace
}  // namespace cohort

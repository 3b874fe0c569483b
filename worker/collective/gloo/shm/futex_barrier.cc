#include "worker/collective/gloo/shm/futex_barrier.h"

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace cohort {
namespace {

// The CPUs this process may run on.
int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

// options.spin if set; else $COHORT_SHM_SPIN_US if set; else 50 us when
// the group's ranks fit on this process's CPUs, and none otherwise.
absl::Duration DefaultSpin(absl::Duration configured, int size) {
  if (configured >= absl::ZeroDuration()) return configured;
  int64_t micros = 0;
  if (const char* env = std::getenv("COHORT_SHM_SPIN_US");
      env != nullptr && absl::SimpleAtoi(env, &micros) && micros >= 0) {
    return absl::Microseconds(micros);
  }
  return size <= UsableCpus() ? absl::Microseconds(50) : absl::ZeroDuration();
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Whether a count read from a peer's word has reached `generation` (counts
// wrap around).
inline bool Reached(uint32_t value, uint32_t generation) {
  return static_cast<int32_t>(value - generation) >= 0;
}

}  // namespace

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(timeout);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected,
          &ts, nullptr, 0);
}

void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX,
          nullptr, nullptr, 0);
}

bool ProcessGone(pid_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  const char state = line[paren + 2];
  return state == 'Z' || state == 'X';
}

FutexBarrier::FutexBarrier(int rank, std::vector<BarrierWords*> words,
                           FutexBarrierOptions options)
    : rank_(rank),
      size_(static_cast<int>(words.size())),
      words_(std::move(words)),
      options_(std::move(options)),
      spin_(DefaultSpin(options_.spin, size_)),
      pid_visible_(size_, false) {}

int FutexBarrier::GroupRank(int local) const {
  return options_.group_ranks.empty() ? local : options_.group_ranks[local];
}

void FutexBarrier::NotePeers() {
  for (int q = 0; q < size_; ++q) {
    const pid_t pid = words_[q]->pid.load();
    pid_visible_[q] = pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
  }
}

absl::Status FutexBarrier::Arrive(absl::Time deadline) {
  const uint32_t generation = ++generation_;
  BarrierWords& me = *words_[rank_];
  me.arrived.store(generation);
  if (me.sleepers.load() > 0) FutexWake(&me.arrived);
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    absl::Status arrived = AwaitPeer(q, generation, deadline);
    if (!arrived.ok()) return arrived;
  }
  return absl::OkStatus();
}

absl::Status FutexBarrier::AwaitPeer(int peer, uint32_t generation,
                                     absl::Time deadline) {
  std::atomic<uint32_t>& word = words_[peer]->arrived;
  if (Reached(word.load(std::memory_order_acquire), generation)) {
    return absl::OkStatus();
  }
  if (spin_ > absl::ZeroDuration()) {
    const absl::Time until = absl::Now() + spin_;
    for (int i = 1;; ++i) {
      CpuRelax();
      if (Reached(word.load(std::memory_order_acquire), generation)) {
        return absl::OkStatus();
      }
      if (i % 64 == 0 && absl::Now() > until) break;
    }
  } else {
    sched_yield();
  }
  return SleepOnPeer(peer, generation, deadline);
}

absl::Status FutexBarrier::SleepOnPeer(int peer, uint32_t generation,
                                       absl::Time deadline) {
  BarrierWords& words = *words_[peer];
  while (true) {
    words.sleepers.fetch_add(1);
    const uint32_t seen = words.arrived.load();
    if (!Reached(seen, generation)) {
      const absl::Duration left = deadline - absl::Now();
      if (left > absl::ZeroDuration()) {
        FutexWait(&words.arrived, seen, std::min(left, kFutexSlice));
      }
    }
    words.sleepers.fetch_sub(1);
    if (Reached(words.arrived.load(std::memory_order_acquire), generation)) {
      return absl::OkStatus();
    }
    if (options_.failed != nullptr) {
      absl::Status failed = options_.failed();
      if (!failed.ok()) return failed;
    }
    const pid_t pid = words.pid.load();
    if (pid_visible_[peer] && ProcessGone(pid)) {
      return absl::UnavailableError(
          absl::StrCat("rank ", GroupRank(peer), " (pid ", pid,
                       ", on this host) exited during the op"));
    }
    if (absl::Now() >= deadline) {
      std::vector<int> late;
      for (int q = 0; q < size_; ++q) {
        if (q != rank_ && !Reached(words_[q]->arrived.load(), generation)) {
          late.push_back(GroupRank(q));
        }
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "rank(s) ", absl::StrJoin(late, ", "),
          " did not reach the op's step ", generation, " within ",
          absl::FormatDuration(options_.timeout), " (shared memory)"));
    }
  }
}

}  // namespace cohort

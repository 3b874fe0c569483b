// FutexBarrier: the barrier of the shared-memory transport (shm_group.h)
// among the local ranks of one host, over words each rank owns in a shared
// segment (segment.h lays them out), with no syscall while peers keep up.
//
// A rank arrives by storing its barrier count in its own `arrived` word,
// waking the peers that sleep on it, and waits for every peer's count to
// reach its own. Waiting spins for a bounded time (when the group's ranks
// fit on the host's CPUs; otherwise it yields at once), then sleeps on the
// peer's word with futex(2) in slices of at most kFutexSlice, checking
// between slices whether the peer's process still exists, whether any rank
// marked the group failed, and the deadline. So a dead peer is seen within
// a slice, a stuck one at the deadline, and 4 ranks on 2 cores progress.
//
// Thread-compatible: one rank's barrier is used by one thread at a time.
#ifndef COHORT_WORKER_COLLECTIVE_GLOO_SHM_FUTEX_BARRIER_H_
#define COHORT_WORKER_COLLECTIVE_GLOO_SHM_FUTEX_BARRIER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace cohort {

// The longest a waiter sleeps before it checks its peers again.
inline constexpr absl::Duration kFutexSlice = absl::Milliseconds(20);

// futex(2) on a 32-bit word, which may lie in memory shared between
// processes. FutexWait sleeps while *word == expected, for at most
// `timeout`; it may return early (woken, interrupted, or the word changed).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               absl::Duration timeout);
// Wakes every thread sleeping on `word`.
void FutexWake(std::atomic<uint32_t>* word);

// Whether `pid` has exited: it no longer exists, or it is a zombie waiting
// for its parent.
bool ProcessGone(pid_t pid);

// One local rank's words, in the shared segment.
struct BarrierWords {
  std::atomic<uint32_t> arrived;   // Barriers arrived at; the futex word.
  std::atomic<uint32_t> sleepers;  // Peers in FUTEX_WAIT on `arrived`.
  std::atomic<int32_t> pid;        // The rank's process; 0 until attached.
};

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "futex words must be plain lock-free 32-bit atomics");

struct FutexBarrierOptions {
  // How long a wait spins before it sleeps. Negative: $COHORT_SHM_SPIN_US
  // if set, else 50 us when the group's ranks fit on the CPUs this process
  // may run on, else none.
  absl::Duration spin = absl::Microseconds(-1);
  // Named in DEADLINE_EXCEEDED messages: what the deadline was set from.
  absl::Duration timeout;
  // The number of each local rank in the enclosing group, for messages.
  // Empty: local ranks are the group's ranks.
  std::vector<int> group_ranks;
  // Called between slices: OK while the group is healthy, else the status
  // a wait returns (a rank marked the group failed). Null: never failed.
  std::function<absl::Status()> failed;
};

class FutexBarrier {
 public:
  // Local rank `rank` of words.size(); `words[q]` are local rank q's.
  FutexBarrier(int rank, std::vector<BarrierWords*> words,
               FutexBarrierOptions options);

  // Records which peers' processes are visible from here, so that their
  // exit can be seen (ranks in another pid namespace, e.g. other containers
  // sharing /dev/shm, are waited for until the deadline only). REQUIRES:
  // every rank has stored its pid.
  void NotePeers();

  // Arrives at the next barrier and waits for every peer to arrive at it.
  // OK; `failed`'s status; UNAVAILABLE naming a peer whose process exited;
  // DEADLINE_EXCEEDED at `deadline` naming the ranks that did not arrive.
  absl::Status Arrive(absl::Time deadline);

  // Barriers this rank has arrived at.
  uint32_t generation() const { return generation_; }

 private:
  absl::Status AwaitPeer(int peer, uint32_t generation, absl::Time deadline);
  // The slow part of AwaitPeer: sleeps in slices, checking the group.
  absl::Status SleepOnPeer(int peer, uint32_t generation, absl::Time deadline);
  int GroupRank(int local) const;

  const int rank_;
  const int size_;
  const std::vector<BarrierWords*> words_;
  const FutexBarrierOptions options_;
  const absl::Duration spin_;
  std::vector<bool> pid_visible_;
  uint32_t generation_ = 0;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_GLOO_SHM_FUTEX_BARRIER_H_

// KvStore on a shared engine (KvEngine::shared(): etcd, for cohortd
// replicas): commits go to the engine without the store's lock, guarded by
// the revisions of what they read, and every change, this replica's own
// included, comes back through the engine's feed (OnFeed), which updates
// the store's view, its history and its waits. Reads first wait for the
// view to hold every change acknowledged before them (CatchUp).
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "store/kv_store.h"

namespace cohort::store {
namespace {

// How long a call on a shared engine waits for the feed to bring what it
// needs (its own commit, or the barrier of a read).
constexpr absl::Duration kFeedTimeout = absl::Seconds(10);

// Attempts of a guarded commit that keeps losing to other writers.
constexpr int kMaxGuardedAttempts = 64;

}  // namespace

absl::StatusOr<int64_t> KvStore::MultiSetShared(
    std::vector<Mutation> mutations) {
  // Guarded by each key's revision, so that a commit whose answer was lost
  // and that reaches etcd late cannot land after a later write of one of
  // its keys (bringing old values back): it fails its guards instead.
  for (int attempt = 1;; ++attempt) {
    std::vector<KvEngine::Guard> guards;
    {
      absl::MutexLock lock(&mu_);
      if (absl::Status s = CheckSharesLocked(mutations); !s.ok()) return s;
      for (const Mutation& m : mutations) {
        guards.push_back({m.key, engine_->ModRevision(m.key)});
      }
    }
    absl::StatusOr<int64_t> committed =
        shared_->ApplyGuarded(mutations, guards);
    if (absl::IsAborted(committed.status()) &&
        attempt < kMaxGuardedAttempts) {
      // Another writer got there first: take its change, and go again.
      if (absl::Status s = CatchUp(); !s.ok()) return s;
      continue;
    }
    if (!committed.ok()) return committed.status();
    AwaitRevision(*committed, kFeedTimeout).IgnoreError();
    return committed;
  }
}

std::vector<ChangeResult> KvStore::ApplyBatchShared(
    absl::Span<const Change> changes) {
  // A queue is many keys: guards catch another replica's push or pop of
  // the same item, but only a view that holds every push acknowledged
  // before this call numbers this one after them.
  for (const Change& c : changes) {
    if (c.kind != Change::Kind::kQueuePush &&
        c.kind != Change::Kind::kQueuePop) {
      continue;
    }
    if (absl::Status s = CatchUp(); !s.ok()) {
      std::vector<ChangeResult> results(changes.size());
      for (ChangeResult& r : results) r.status = s;
      return results;
    }
    break;
  }
  bool caught_up = false;
  for (int attempt = 1;; ++attempt) {
    std::vector<ChangeResult> results(changes.size());
    std::vector<Mutation> mutations;
    std::vector<size_t> writers;
    std::vector<KvEngine::Guard> guards;
    int64_t revision;
    {
      absl::MutexLock lock(&mu_);
      PlanLocked(changes, results, mutations, writers, &guards);
      revision = revision_;
    }
    if (mutations.empty() && !guards.empty() && !caught_up) {
      // Changes that read and then wrote nothing (a compare_set that did
      // not match, a delete of a missing key): no commit checks their
      // reads, so they must come from a view that holds every change
      // acknowledged before this call. Plan them again from one.
      if (absl::Status s = CatchUp(); !s.ok()) {
        for (ChangeResult& r : results) {
          if (r.status.ok()) r.status = s;
        }
        return results;
      }
      caught_up = true;
      continue;
    }
    if (!mutations.empty()) {
      absl::StatusOr<int64_t> committed =
          shared_->ApplyGuarded(mutations, guards);
      if (absl::IsAborted(committed.status()) &&
          attempt < kMaxGuardedAttempts) {
        // Another writer changed a key this batch read: read it again.
        if (absl::Status s = CatchUp(); !s.ok())
          committed = s;
        else
          continue;
      }
      if (committed.ok()) {
        revision = *committed;
        // Read-your-writes: the reply waits for the view to hold it.
        AwaitRevision(revision, kFeedTimeout).IgnoreError();
      } else {
        for (size_t i : writers) {
          results[i].status = committed.status();
          results[i].number = 0;
        }
      }
    }
    for (ChangeResult& r : results) r.revision = revision;
    return results;
  }
}

void KvStore::OnFeed(int64_t revision, std::vector<Mutation> mutations) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    const int64_t loaded = history_.loaded_revision();
    if (revision <= revision_ && mutations.empty() && revision == loaded &&
        loaded > 0) {
      // The engine says its replay is whole.
      history_.FinishReplay();
      return;
    }
    if (revision <= revision_) {
      // A change from before the store loaded: history only, so that a
      // watch may resume from it.
      history_.Replay(revision, std::move(mutations));
      return;
    }
    if (loaded > 0) history_.FinishReplay();
    if (!mutations.empty()) {
      // Updates the engine's view only: the change is already committed.
      if (absl::Status s = ApplyLocked(mutations, revision); !s.ok()) return;
      PublishLocked(revision, std::move(mutations), deferred);
    }
    revision_ = revision;
  }
  for (auto& fn : deferred) fn();
}

absl::Status KvStore::AwaitRevision(int64_t target, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto reached = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return revision_ >= target;
  };
  if (mu_.AwaitWithTimeout(absl::Condition(&reached), timeout)) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat(
      "the store's view is at revision ", revision_, " and did not reach ",
      target, " within ", absl::FormatDuration(timeout),
      ": the shared engine's change feed is behind or cut off"));
}

absl::Status KvStore::CatchUp() {
  if (shared_ == nullptr) return absl::OkStatus();
  absl::StatusOr<int64_t> barrier = shared_->ReadBarrier();
  if (!barrier.ok()) return barrier.status();
  return AwaitRevision(*barrier, kFeedTimeout);
}

}  // namespace cohort::store

// WatchHistory: the changes KvStore keeps for watches to resume from, and
// the open watches it delivers every new change to.
//
// The history is bounded by a count of events and their bytes; the oldest
// revisions are dropped whole past either bound, so a resumed watch never
// sees half of one. On a shared engine it also takes the changes from
// before the store loaded, which the engine's feed replays first, so that
// a watch may resume from them too.
//
// Not thread-safe: it is part of KvStore's state, and every call REQUIRES
// the store's lock (KvStore holds it ABSL_GUARDED_BY that lock). Watch
// callbacks run under that lock.
#ifndef COHORT_STORE_WATCH_HISTORY_H_
#define COHORT_STORE_WATCH_HISTORY_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "store/kv_engine.h"

namespace cohort::store {

struct Event {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  std::string key;
  // Shared between the history and every watcher: one copy per change.
  std::shared_ptr<const std::string> value;  // Null for kDelete.
  int64_t revision = 0;
};

class WatchHistory {
 public:
  using WatchId = uint64_t;
  // Called with events in revision order, under the store's lock: it must
  // not block or call back into the store.
  using EventsCallback = std::function<void(std::vector<Event>)>;
  // Called once when the store ends a watch (Shutdown); not after Cancel.
  using CloseCallback = std::function<void(absl::Status)>;

  struct Watcher {
    std::string prefix;
    int64_t start_revision = 0;
    EventsCallback on_events;
    CloseCallback on_close;
  };

  struct WatchStart {
    WatchId id = 0;
    // The watch delivers every change with revision >= this.
    int64_t start_revision = 0;
  };

  // Keeps at most `max_events` events and `max_bytes` of them (keys,
  // values and bookkeeping); holds nothing at or before `revision`.
  WatchHistory(size_t max_events, size_t max_bytes, int64_t revision);

  // The events of `mutations`, applied together at `revision`: each value
  // moved into one shared copy. Sets *deleted (if given) when one of them
  // is a delete.
  static std::vector<Event> EventsOf(int64_t revision,
                                     std::vector<Mutation> mutations,
                                     bool* deleted);

  // Calls each watch that covers `revision` with those of `events` (all at
  // `revision`) under its prefix, if any.
  void Deliver(int64_t revision, const std::vector<Event>& events);
  // Keeps `events` (newer than every event kept), then drops the oldest
  // revisions past the bounds.
  void Append(std::vector<Event> events);

  // Opens a watch of the changes under `prefix` from `from_revision` (0:
  // the ones after `revision`, the store's current), calling `on_events`
  // with the kept ones at once. OUT_OF_RANGE if from_revision is no longer
  // kept. A from_revision beyond `revision` is valid: the watch delivers
  // changes once the store reaches it, and none before.
  absl::StatusOr<WatchStart> Watch(absl::string_view prefix,
                                   int64_t from_revision, int64_t revision,
                                   EventsCallback on_events,
                                   CloseCallback on_close);
  // Closes a watch without calling its on_close. Unknown ids are ignored.
  void Cancel(WatchId id) { watchers_.erase(id); }
  // Every open watch, taken out, for the caller to close after the lock.
  absl::flat_hash_map<WatchId, Watcher> TakeAll();
  size_t watch_count() const { return watchers_.size(); }

  // A shared engine's replay of the changes up to `loaded_revision`, the
  // revision the store loaded at: until FinishReplay, resuming watches stay
  // refused below it, since the history is not contiguous yet.
  void ExpectReplay(int64_t loaded_revision) {
    loaded_revision_ = loaded_revision;
  }
  // The revision the replay is to reach; 0 once it is over (or none is).
  int64_t loaded_revision() const { return loaded_revision_; }
  // A replayed change from before the store loaded: kept for the history
  // only, if it is newer than every event kept.
  void Replay(int64_t revision, std::vector<Mutation> mutations);
  // The replay reached the loaded revision: the history now reaches back to
  // its start.
  void FinishReplay();

 private:
  // Drops the oldest revisions, whole, while over a bound.
  void Trim();

  const size_t max_events_;
  const size_t max_bytes_;
  WatchId next_watch_id_ = 1;
  absl::flat_hash_map<WatchId, Watcher> watchers_;
  std::deque<Event> events_;
  size_t bytes_ = 0;
  // Changes at or below this revision are no longer in events_.
  int64_t compacted_revision_ = 0;
  // The first revision replayed (0: none yet). compacted_revision_ moves
  // down to it once the replay has reached loaded_revision_.
  int64_t replayed_from_ = 0;
  int64_t loaded_revision_ = 0;
};

}  // namespace cohort::store

#endif  // COHORT_STORE_WATCH_HISTORY_H_

#include "store/watch_history.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace cohort::store {
namespace {

size_t EventBytes(const Event& e) {
  return sizeof(Event) + e.key.size() + (e.value ? e.value->size() : 0);
}

}  // namespace

WatchHistory::WatchHistory(size_t max_events, size_t max_bytes,
                           int64_t revision)
    : max_events_(max_events),
      max_bytes_(max_bytes),
      compacted_revision_(revision) {}

std::vector<Event> WatchHistory::EventsOf(int64_t revision,
                                          std::vector<Mutation> mutations,
                                          bool* deleted) {
  std::vector<Event> events;
  events.reserve(mutations.size());
  for (Mutation& m : mutations) {
    Event e;
    e.revision = revision;
    if (m.kind == Mutation::Kind::kPut) {
      e.type = Event::Type::kPut;
      e.value = std::make_shared<const std::string>(std::move(m.value));
    } else {
      e.type = Event::Type::kDelete;
      if (deleted != nullptr) *deleted = true;
    }
    e.key = std::move(m.key);
    events.push_back(std::move(e));
  }
  return events;
}

void WatchHistory::Deliver(int64_t revision, const std::vector<Event>& events) {
  for (auto& [id, watcher] : watchers_) {
    if (revision < watcher.start_revision) continue;
    std::vector<Event> matching;
    for (const Event& e : events) {
      if (absl::StartsWith(e.key, watcher.prefix)) {
        matching.push_back(e);
      }
    }
    if (!matching.empty()) watcher.on_events(std::move(matching));
  }
}

void WatchHistory::Append(std::vector<Event> events) {
  for (Event& e : events) {
    bytes_ += EventBytes(e);
    events_.push_back(std::move(e));
  }
  Trim();
}

void WatchHistory::Trim() {
  while (!events_.empty() &&
         (events_.size() > max_events_ || bytes_ > max_bytes_)) {
    // Drop whole revisions, so a resumed watch never sees half of one.
    const int64_t dropped = events_.front().revision;
    while (!events_.empty() && events_.front().revision == dropped) {
      bytes_ -= EventBytes(events_.front());
      events_.pop_front();
    }
    compacted_revision_ = dropped;
  }
}

absl::StatusOr<WatchHistory::WatchStart> WatchHistory::Watch(
    absl::string_view prefix, int64_t from_revision, int64_t revision,
    EventsCallback on_events, CloseCallback on_close) {
  WatchStart start;
  start.start_revision = from_revision == 0 ? revision + 1 : from_revision;
  if (start.start_revision <= compacted_revision_) {
    return absl::OutOfRangeError(absl::StrCat(
        "revision ", from_revision,
        " is no longer in the watch history (it "
        "holds revisions after ",
        compacted_revision_,
        "; history is bounded and starts afresh when cohortd restarts): list "
        "the keys, then watch from the listing's revision + 1"));
  }
  std::vector<Event> replay;
  for (const Event& e : events_) {
    if (e.revision >= start.start_revision && absl::StartsWith(e.key, prefix)) {
      replay.push_back(e);
    }
  }
  if (!replay.empty()) on_events(std::move(replay));
  start.id = next_watch_id_++;
  watchers_.emplace(start.id,
                    Watcher{std::string(prefix), start.start_revision,
                            std::move(on_events), std::move(on_close)});
  return start;
}

absl::flat_hash_map<WatchHistory::WatchId, WatchHistory::Watcher>
WatchHistory::TakeAll() {
  absl::flat_hash_map<WatchId, Watcher> all;
  all.swap(watchers_);
  return all;
}

void WatchHistory::Replay(int64_t revision, std::vector<Mutation> mutations) {
  if (revision > loaded_revision_ || mutations.empty() ||
      (!events_.empty() && events_.back().revision >= revision)) {
    return;
  }
  if (replayed_from_ == 0) replayed_from_ = revision;
  Append(EventsOf(revision, std::move(mutations), nullptr));
  // Until the replay is over the history is not contiguous: resuming
  // watches stay refused below the loaded revision.
  compacted_revision_ = loaded_revision_;
}

void WatchHistory::FinishReplay() {
  // The history now reaches back to the replay's start.
  if (replayed_from_ > 0 && !events_.empty() &&
      events_.front().revision <= loaded_revision_) {
    compacted_revision_ = events_.front().revision - 1;
  }
  replayed_from_ = 0;
  loaded_revision_ = 0;
}

}  // namespace cohort::store

#include "store/watch_history.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace cohort::store {
namespace {

Mutation Put(std::string key, std::string value) {
  Mutation m;
  m.key = std::move(key);
  m.value = std::move(value);
  return m;
}

Mutation Delete(std::string key) {
  Mutation m;
  m.kind = Mutation::Kind::kDelete;
  m.key = std::move(key);
  return m;
}

// "key@revision" for each event.
std::vector<std::string> Names(const std::vector<Event>& events) {
  std::vector<std::string> out;
  for (const Event& e : events) {
    out.push_back(e.key + "@" + std::to_string(e.revision));
  }
  return out;
}

void Commit(WatchHistory& history, int64_t revision,
            std::vector<Mutation> mutations) {
  std::vector<Event> events =
      WatchHistory::EventsOf(revision, std::move(mutations), nullptr);
  history.Deliver(revision, events);
  history.Append(std::move(events));
}

TEST(WatchHistoryTest, EventsOfACommit) {
  bool deleted = false;
  std::vector<Event> events =
      WatchHistory::EventsOf(7, {Put("a", "1")}, &deleted);
  EXPECT_FALSE(deleted);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, Event::Type::kPut);
  EXPECT_EQ(*events[0].value, "1");
  EXPECT_EQ(events[0].revision, 7);
  events = WatchHistory::EventsOf(8, {Put("a", "2"), Delete("b")}, &deleted);
  EXPECT_TRUE(deleted);
  EXPECT_EQ(events[1].type, Event::Type::kDelete);
  EXPECT_EQ(events[1].value, nullptr);
  EXPECT_EQ(Names(events), (std::vector<std::string>{"a@8", "b@8"}));
}

TEST(WatchHistoryTest, AWatchGetsTheChangesUnderItsPrefix) {
  WatchHistory history(100, 1 << 20, /*revision=*/0);
  Commit(history, 1, {Put("job/a", "1"), Put("other", "1")});
  std::vector<std::string> seen;
  auto watch = history.Watch(
      "job/", /*from_revision=*/1, /*revision=*/1,
      [&](std::vector<Event> events) {
        for (const std::string& n : Names(events)) seen.push_back(n);
      },
      [](absl::Status) {});
  ASSERT_TRUE(watch.ok()) << watch.status();
  EXPECT_EQ(watch->start_revision, 1);
  EXPECT_EQ(seen, std::vector<std::string>{"job/a@1"});  // Kept, replayed.
  Commit(history, 2, {Put("other", "2"), Delete("job/a")});
  EXPECT_EQ(seen, (std::vector<std::string>{"job/a@1", "job/a@2"}));
  EXPECT_EQ(history.watch_count(), 1u);
  history.Cancel(watch->id);
  Commit(history, 3, {Put("job/b", "3")});
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_EQ(history.watch_count(), 0u);
}

TEST(WatchHistoryTest, FromZeroMeansAfterNowAndTheFutureIsValid) {
  WatchHistory history(100, 1 << 20, /*revision=*/4);
  int calls = 0;
  auto now = history.Watch(
      "", 0, 4, [&](std::vector<Event>) { ++calls; }, [](absl::Status) {});
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->start_revision, 5);
  auto later = history.Watch(
      "", 9, 4, [&](std::vector<Event>) { ++calls; }, [](absl::Status) {});
  ASSERT_TRUE(later.ok());
  Commit(history, 5, {Put("k", "v")});
  EXPECT_EQ(calls, 1) << "the watch from 9 sees nothing at 5";
}

TEST(WatchHistoryTest, TrimDropsWholeRevisionsAndRefusesThem) {
  WatchHistory history(/*max_events=*/2, 1 << 20, /*revision=*/0);
  Commit(history, 1, {Put("a", "1"), Put("b", "1")});
  Commit(history, 2, {Put("c", "2")});
  auto old = history.Watch(
      "", 1, 2, [](std::vector<Event>) {}, [](absl::Status) {});
  EXPECT_EQ(old.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(absl::StrContains(
      old.status().message(),
      "revision 1 is no longer in the watch history (it holds revisions "
      "after 1;"))
      << old.status();
  std::vector<std::string> seen;
  auto kept = history.Watch(
      "", 2, 2, [&](std::vector<Event> events) { seen = Names(events); },
      [](absl::Status) {});
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(seen, std::vector<std::string>{"c@2"});
}

TEST(WatchHistoryTest, BytesBoundTheHistoryToo) {
  WatchHistory history(100, /*max_bytes=*/sizeof(Event) + 10, 0);
  Commit(history, 1, {Put("a", "123456789")});
  Commit(history, 2, {Put("b", "1")});
  EXPECT_FALSE(history
                   .Watch(
                       "", 1, 2, [](std::vector<Event>) {}, [](absl::Status) {})
                   .ok());
  EXPECT_TRUE(history
                  .Watch(
                      "", 2, 2, [](std::vector<Event>) {}, [](absl::Status) {})
                  .ok());
}

TEST(WatchHistoryTest, AReplayIsRefusedUntilItIsWhole) {
  WatchHistory history(100, 1 << 20, /*revision=*/5);
  history.ExpectReplay(5);
  EXPECT_EQ(history.loaded_revision(), 5);
  history.Replay(3, {Put("a", "3")});
  history.Replay(3, {Put("a", "again")});  // Not newer: ignored.
  history.Replay(4, {});                   // Nothing: ignored.
  auto early = history.Watch(
      "", 3, 5, [](std::vector<Event>) {}, [](absl::Status) {});
  EXPECT_EQ(early.status().code(), absl::StatusCode::kOutOfRange);
  history.Replay(5, {Delete("a")});
  history.FinishReplay();
  EXPECT_EQ(history.loaded_revision(), 0);
  std::vector<std::string> seen;
  auto whole = history.Watch(
      "", 3, 5, [&](std::vector<Event> events) { seen = Names(events); },
      [](absl::Status) {});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(seen, (std::vector<std::string>{"a@3", "a@5"}));
  EXPECT_FALSE(history
                   .Watch(
                       "", 2, 5, [](std::vector<Event>) {}, [](absl::Status) {})
                   .ok());
}

TEST(WatchHistoryTest, TakeAllHandsOverTheWatches) {
  WatchHistory history(100, 1 << 20, 0);
  std::vector<absl::Status> closed;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(history
                    .Watch(
                        "", 0, 0, [](std::vector<Event>) {},
                        [&](absl::Status s) { closed.push_back(s); })
                    .ok());
  }
  auto all = history.TakeAll();
  EXPECT_EQ(all.size(), 2u);
  EXPECT_EQ(history.watch_count(), 0u);
  for (auto& [id, watcher] : all) watcher.on_close(absl::CancelledError());
  EXPECT_EQ(closed.size(), 2u);
}

}  // namespace
}  // namespace cohort::store

// EtcdEngine against FakeEtcd (fake_etcd.h): the engine's own gRPC code
// talks to in-process etcd members that share one store, and a test writes
// straight into that store as another writer, or stops members.
#include "server/ha/etcd_engine.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/ha/fake_etcd.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"

namespace cohort::server {
namespace {

using store::KvEngine;
using store::Mutation;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// How long a test waits for something it expects before failing: a guard
// against hanging, not a bound the test asserts.
constexpr absl::Duration kPatience = absl::Seconds(60);

EtcdEngineOptions Options(const FakeEtcd& etcd,
                          std::string prefix = "/cohort/kv/") {
  EtcdEngineOptions o;
  o.endpoints = etcd.endpoints();
  o.prefix = std::move(prefix);
  o.connect_timeout = kPatience;
  return o;
}

std::unique_ptr<KvEngine> Open(EtcdEngineOptions options) {
  absl::StatusOr<std::unique_ptr<KvEngine>> engine =
      OpenEtcdEngine(std::move(options));
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

Mutation Put(std::string key, std::string value) {
  Mutation m;
  m.key = std::move(key);
  m.value = std::move(value);
  return m;
}

Mutation Del(std::string key) {
  Mutation m;
  m.kind = Mutation::Kind::kDelete;
  m.key = std::move(key);
  return m;
}

// "put k=v" / "delete k", for comparing feeds.
std::vector<std::string> Describe(const std::vector<Mutation>& mutations) {
  std::vector<std::string> out;
  for (const Mutation& m : mutations) {
    out.push_back(m.kind == Mutation::Kind::kPut
                      ? absl::StrCat("put ", m.key, "=", m.value)
                      : absl::StrCat("delete ", m.key));
  }
  return out;
}

// Follows an engine's feed as KvStore does (changes after the load are
// applied to the view, under one lock with every read of it), and keeps
// what the feed delivered, in order.
class Follower {
 public:
  struct Entry {
    int64_t revision;
    std::vector<std::string> changes;  // Describe()d.
  };

  explicit Follower(KvEngine* engine)
      : engine_(engine), revision_(engine->revision()) {
    absl::Status s = engine_->StartFeed(
        [this](int64_t revision, std::vector<Mutation> mutations) {
          OnFeed(revision, std::move(mutations));
        });
    EXPECT_TRUE(s.ok()) << s;
  }
  ~Follower() { engine_->StopFeed(); }

  // Whether the view reached `revision` (false: not within kPatience).
  bool AwaitRevision(int64_t revision) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return revision_ >= revision;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), kPatience);
  }

  // Whether the feed delivered `n` entries (false: not within kPatience).
  bool AwaitEntries(size_t n) {
    absl::MutexLock lock(&mu_);
    auto delivered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return entries_.size() >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&delivered), kPatience);
  }

  std::vector<Entry> entries() {
    absl::MutexLock lock(&mu_);
    return entries_;
  }
  std::vector<int64_t> revisions() {
    std::vector<int64_t> out;
    for (const Entry& e : entries()) out.push_back(e.revision);
    return out;
  }

  std::optional<std::string> Get(absl::string_view key) {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<std::optional<std::string>> v = engine_->Get(key);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : std::nullopt;
  }
  int64_t ModRevision(absl::string_view key) {
    absl::MutexLock lock(&mu_);
    return engine_->ModRevision(key);
  }
  int64_t NumKeys() {
    absl::MutexLock lock(&mu_);
    return engine_->NumKeys();
  }
  std::vector<std::string> Keys() {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<std::vector<std::string>> keys =
        engine_->ListKeys("", "", 1000);
    EXPECT_TRUE(keys.ok()) << keys.status();
    return keys.ok() ? *keys : std::vector<std::string>();
  }

 private:
  void OnFeed(int64_t revision, std::vector<Mutation> mutations) {
    absl::MutexLock lock(&mu_);
    entries_.push_back({revision, Describe(mutations)});
    if (revision <= revision_) return;  // Replayed from before the load.
    if (!mutations.empty()) {
      absl::Status s = engine_->Apply(mutations, revision);
      EXPECT_TRUE(s.ok()) << s;
    }
    revision_ = revision;
  }

  KvEngine* const engine_;
  absl::Mutex mu_;
  int64_t revision_ ABSL_GUARDED_BY(mu_);
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

// Between the tries of a call that waits for a member to come back.
bool Pause() {
  absl::SleepFor(absl::Milliseconds(20));
  return true;
}

// Sets each of `keys` to "1" through `writer`, one commit each; returns
// the commits' revisions (fewer if one failed).
std::vector<int64_t> CommitEach(KvEngine& writer,
                                const std::vector<std::string>& keys) {
  std::vector<int64_t> commits;
  for (const std::string& key : keys) {
    absl::StatusOr<int64_t> r = writer.ApplyGuarded({Put(key, "1")}, {});
    EXPECT_TRUE(r.ok()) << key << ": " << r.status();
    if (!r.ok()) break;
    commits.push_back(*r);
  }
  return commits;
}

std::unique_ptr<FakeEtcd> StartEtcd(int members = 1) {
  absl::StatusOr<std::unique_ptr<FakeEtcd>> etcd = FakeEtcd::Start(members);
  EXPECT_TRUE(etcd.ok()) << etcd.status();
  return etcd.ok() ? std::move(*etcd) : nullptr;
}

TEST(EtcdPrefixEndTest, IsThePrefixWithItsLastByteIncremented) {
  EXPECT_EQ(EtcdPrefixEnd("/cohort/kv/"), "/cohort/kv0");
  EXPECT_EQ(EtcdPrefixEnd("a\xff"), "b");
  EXPECT_EQ(EtcdPrefixEnd("\xff\xff"), std::string(1, '\0'));
  EXPECT_EQ(EtcdPrefixEnd(""), std::string(1, '\0'));
}

TEST(EtcdEngineTest, RefusesBadOptions) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  EtcdEngineOptions none = Options(*etcd);
  none.endpoints.clear();
  EXPECT_EQ(OpenEtcdEngine(none).status().code(),
            absl::StatusCode::kInvalidArgument);
  EtcdEngineOptions no_port = Options(*etcd);
  no_port.endpoints = {"localhost"};
  EXPECT_THAT(OpenEtcdEngine(no_port).status().message(),
              HasSubstr("'localhost' is not HOST:PORT"));
  EXPECT_EQ(OpenEtcdEngine(Options(*etcd, "")).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(EtcdEngineTest, OpensOnAnEmptyPrefix) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  std::unique_ptr<KvEngine> engine = Open(Options(*etcd));
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->name(), "etcd");
  EXPECT_TRUE(engine->shared());
  EXPECT_EQ(engine->NumKeys(), 0);
  EXPECT_EQ(engine->revision(), etcd->revision());
  absl::StatusOr<int64_t> barrier = engine->ReadBarrier();
  ASSERT_TRUE(barrier.ok()) << barrier.status();
  EXPECT_EQ(*barrier, 0);  // Nothing committed through cohortd yet.
  EXPECT_TRUE(engine->CheckWritable().ok());

  // With no history to replay, the feed says at once that it is whole.
  Follower follower(engine.get());
  ASSERT_TRUE(follower.AwaitEntries(1));
  EXPECT_EQ(follower.entries()[0].revision, engine->revision());
  EXPECT_TRUE(follower.entries()[0].changes.empty());
}

// The view is loaded in pages of kLoadPage (1000) keys, each read at the
// revision of the first page: a write between pages is not half in the
// view, it comes through the watch afterwards.
TEST(EtcdEngineTest, LoadsAPrefilledPrefixAcrossRangePagesAtOneRevision) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  constexpr int kKeys = 2500;  // 3 pages.
  for (int i = 0; i < kKeys; ++i) {
    ASSERT_TRUE(etcd->Put(absl::StrFormat("/cohort/kv/key%05d", i),
                          absl::StrCat("v", i))
                    .ok());
  }
  // Beside the prefix, not under it.
  for (const char* outside : {"/cohort/kv", "/cohort/kv0/a", "/cohort/a",
                              "/cohort/zz", "/other/key00001"}) {
    ASSERT_TRUE(etcd->Put(outside, "outside").ok());
  }
  const int64_t loaded = etcd->revision();
  bool written = false;
  etcd->SetRangeHook([&](int, const etcdserverpb::RangeRequest& req) {
    if (req.key() == "/cohort/kv/" || written) return;
    written = true;  // Before the second page.
    ASSERT_TRUE(etcd->Put("/cohort/kv/key02400", "changed").ok());
    ASSERT_TRUE(etcd->Put("/cohort/kv/late", "late").ok());
    ASSERT_TRUE(etcd->Put("/cohort/kv/key00000", "changed").ok());
  });

  std::unique_ptr<KvEngine> engine = Open(Options(*etcd));
  ASSERT_NE(engine, nullptr);
  etcd->SetRangeHook(nullptr);
  EXPECT_TRUE(written);
  EXPECT_EQ(etcd->calls(0, "Range"), 3);
  EXPECT_EQ(engine->revision(), loaded);
  EXPECT_EQ(engine->NumKeys(), kKeys);
  for (int i = 0; i < kKeys; ++i) {
    const std::string key = absl::StrFormat("key%05d", i);
    absl::StatusOr<std::optional<std::string>> v = engine->Get(key);
    ASSERT_TRUE(v.ok() && v->has_value()) << key;
    EXPECT_EQ(**v, absl::StrCat("v", i)) << key;
    EXPECT_EQ(engine->ModRevision(key), i + 2) << key;  // etcd starts at 1.
  }
  EXPECT_FALSE(engine->Contains("late"));
  absl::StatusOr<std::vector<std::string>> first = engine->ListKeys("", "", 1);
  ASSERT_TRUE(first.ok());
  EXPECT_THAT(*first, ElementsAre("key00000"));

  Follower follower(engine.get());
  ASSERT_TRUE(follower.AwaitRevision(etcd->revision()));
  EXPECT_EQ(follower.Get("key02400"), "changed");
  EXPECT_EQ(follower.Get("late"), "late");
  EXPECT_EQ(follower.Get("key00000"), "changed");
  EXPECT_EQ(follower.ModRevision("key00000"), etcd->revision());
  EXPECT_EQ(follower.NumKeys(), kKeys + 1);
}

TEST(EtcdEngineTest, CommitsAreOneTransactionAndComeBackThroughTheWatch) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  std::unique_ptr<KvEngine> engine = Open(Options(*etcd));
  ASSERT_NE(engine, nullptr);
  Follower follower(engine.get());

  absl::StatusOr<int64_t> set = engine->ApplyGuarded({Put("a", "1")}, {});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(*set, etcd->revision());
  ASSERT_TRUE(etcd->Get("/cohort/kv/a").has_value());
  EXPECT_EQ(etcd->Get("/cohort/kv/a")->value(), "1");
  EXPECT_EQ(etcd->Get("/cohort/kv/a")->mod_revision(), *set);
  ASSERT_TRUE(follower.AwaitRevision(*set));
  EXPECT_EQ(follower.Get("a"), "1");
  EXPECT_EQ(follower.ModRevision("a"), *set);

  absl::StatusOr<int64_t> del = engine->ApplyGuarded({Del("a")}, {});
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_EQ(*del, *set + 1);
  EXPECT_FALSE(etcd->Get("/cohort/kv/a").has_value());
  ASSERT_TRUE(follower.AwaitRevision(*del));
  EXPECT_EQ(follower.Get("a"), std::nullopt);
  EXPECT_EQ(follower.ModRevision("a"), 0);

  // A batch naming a key twice: etcd refuses a transaction that does (the
  // fake too), so the engine sends what the batch leaves behind.
  absl::StatusOr<int64_t> batch = engine->ApplyGuarded(
      {Put("b", "1"), Put("c", "1"), Put("b", "2"), Del("c"), Put("d", "4")},
      {});
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_EQ(*batch, *del + 1);
  ASSERT_TRUE(follower.AwaitRevision(*batch));
  EXPECT_EQ(follower.Get("b"), "2");
  EXPECT_EQ(follower.Get("c"), std::nullopt);
  EXPECT_EQ(follower.Get("d"), "4");
  EXPECT_EQ(etcd->calls(0, "Txn"), 3);

  // The feed: the load's "whole" report, then each commit once, in order,
  // the reserved key of the read barrier left out.
  std::vector<Follower::Entry> feed = follower.entries();
  ASSERT_EQ(feed.size(), 4);
  EXPECT_TRUE(feed[0].changes.empty());
  EXPECT_EQ(feed[1].revision, *set);
  EXPECT_THAT(feed[1].changes, ElementsAre("put a=1"));
  EXPECT_EQ(feed[2].revision, *del);
  EXPECT_THAT(feed[2].changes, ElementsAre("delete a"));
  EXPECT_EQ(feed[3].revision, *batch);
  EXPECT_THAT(feed[3].changes, ElementsAre("put b=2", "put d=4"));
}

TEST(EtcdEngineTest, GuardedCommitsApplyOnlyIfWhatTheyReadIsUnchanged) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  std::unique_ptr<KvEngine> engine = Open(Options(*etcd));
  ASSERT_NE(engine, nullptr);
  Follower follower(engine.get());

  absl::StatusOr<int64_t> first = engine->ApplyGuarded({Put("n", "1")}, {});
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<int64_t> second =
      engine->ApplyGuarded({Put("n", "2")}, {KvEngine::Guard{"n", *first}});
  ASSERT_TRUE(second.ok()) << second.status();

  // Guarded on a revision that is no longer n's.
  absl::StatusOr<int64_t> stale =
      engine->ApplyGuarded({Put("n", "3")}, {KvEngine::Guard{"n", *first}});
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(etcd->Get("/cohort/kv/n")->value(), "2");
  EXPECT_EQ(etcd->revision(), *second);

  // Guarded on absence, against another writer that created the key.
  ASSERT_TRUE(etcd->Put("/cohort/kv/m", "theirs").ok());
  absl::StatusOr<int64_t> absent =
      engine->ApplyGuarded({Put("m", "ours")}, {KvEngine::Guard{"m", 0}});
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(etcd->Get("/cohort/kv/m")->value(), "theirs");
  absl::StatusOr<int64_t> fresh =
      engine->ApplyGuarded({Put("o", "ours")}, {KvEngine::Guard{"o", 0}});
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_TRUE(follower.AwaitRevision(*fresh));
  EXPECT_EQ(follower.Get("o"), "ours");
  EXPECT_EQ(follower.Get("m"), "theirs");
}

// Through KvStore, as cohortd uses the engine: a write made straight into
// etcd wakes a waiter, and a read-modify-write goes to etcd.
TEST(EtcdEngineTest, AnotherWritersChangeWakesAKvStoreWaiter) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  std::unique_ptr<KvEngine> engine = Open(Options(*etcd));
  ASSERT_NE(engine, nullptr);
  store::KvStore store(std::move(engine));

  absl::Notification woken;
  absl::StatusOr<store::ReadResult> result;
  store.WaitForKeys({"x"}, /*read_values=*/true, kPatience,
                    [&](absl::StatusOr<store::ReadResult> r) {
                      result = std::move(r);
                      woken.Notify();
                    });
  EXPECT_FALSE(woken.HasBeenNotified());
  ASSERT_TRUE(etcd->Put("/cohort/kv/x", "hello").ok());
  ASSERT_TRUE(woken.WaitForNotificationWithTimeout(kPatience));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_THAT(result->values, ElementsAre("hello"));

  absl::StatusOr<store::AddResult> added = store.Add("counter", 5);
  ASSERT_TRUE(added.ok()) << added.status();
  added = store.Add("counter", 2);
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ(added->value, 7);
  EXPECT_EQ(etcd->Get("/cohort/kv/counter")->value(), "7");
  EXPECT_EQ(added->revision, etcd->revision());
  absl::StatusOr<std::optional<std::string>> read = store.TryGet("counter");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "7");
  store.Shutdown(absl::UnavailableError("test over"));
}

// Two replicas: whatever one acknowledged, the other's next call sees,
// including calls that read without committing (a blocking get whose key
// is in the view already, a compare_set that does not match, a delete of a
// key that is gone). Each takes a read barrier first; without it they were
// answered from a view that had not caught up (the linearizability
// campaign, tests/robustness, caught both).
TEST(EtcdEngineTest, ReplicasSeeWhatTheOtherAcknowledged) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  store::KvStore a(Open(Options(*etcd)));
  store::KvStore b(Open(Options(*etcd)));
  auto blocking_get = [&](store::KvStore& store, const std::string& key) {
    absl::Notification done;
    std::string value = "(none)";
    store.WaitForKeys({key}, /*read_values=*/true, kPatience,
                      [&](absl::StatusOr<store::ReadResult> r) {
                        if (r.ok()) value = r->values[0];
                        done.Notify();
                      });
    done.WaitForNotificationWithTimeout(kPatience);
    return value;
  };
  ASSERT_TRUE(a.Set("k", "old").ok());
  ASSERT_TRUE(a.Set("gone", "1").ok());
  ASSERT_EQ(blocking_get(b, "k"), "old");
  ASSERT_EQ(blocking_get(b, "gone"), "1");
  for (int i = 0; i < 20; ++i) {
    const std::string value = absl::StrCat("v", i);
    ASSERT_TRUE(a.Set("k", value).ok());
    EXPECT_EQ(blocking_get(b, "k"), value);
    ASSERT_TRUE(a.Set("k", value + "x").ok());
    absl::StatusOr<store::CompareSetResult> cas =
        b.CompareSet("k", "no such value", "y");
    ASSERT_TRUE(cas.ok()) << cas.status();
    EXPECT_FALSE(cas->swapped);
    EXPECT_EQ(cas->value, value + "x");
  }
  ASSERT_TRUE(a.Delete("gone").ok());
  absl::StatusOr<store::DeleteResult> deleted = b.Delete("gone");
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_FALSE(deleted->deleted);
  a.Shutdown(absl::UnavailableError("test over"));
  b.Shutdown(absl::UnavailableError("test over"));
}

// The barrier is the last commit made through cohortd (any replica's):
// what a reply acknowledged. A write straight into etcd is no such commit.
TEST(EtcdEngineTest, ReadBarrierIsTheLastCommitThroughAnyReplica) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  std::unique_ptr<KvEngine> engine = Open(Options(*etcd));
  ASSERT_NE(engine, nullptr);
  std::unique_ptr<KvEngine> other = Open(Options(*etcd));
  ASSERT_NE(other, nullptr);
  Follower follower(engine.get());

  absl::StatusOr<int64_t> mine = engine->ApplyGuarded({Put("a", "1")}, {});
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(engine->ReadBarrier().value_or(-1), *mine);

  ASSERT_TRUE(etcd->Put("/cohort/kv/direct", "1").ok());
  EXPECT_EQ(engine->ReadBarrier().value_or(-1), *mine);

  absl::StatusOr<int64_t> theirs = other->ApplyGuarded({Put("b", "1")}, {});
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  absl::StatusOr<int64_t> barrier = engine->ReadBarrier();
  ASSERT_TRUE(barrier.ok()) << barrier.status();
  EXPECT_EQ(*barrier, *theirs);
  // The feed reaches the barrier (the reserved key's change alone would
  // advance it too), and then holds the other replica's write.
  ASSERT_TRUE(follower.AwaitRevision(*barrier));
  EXPECT_EQ(follower.Get("b"), "1");
  EXPECT_EQ(follower.Get("direct"), "1");
}

TEST(EtcdEngineTest, FailsOverToTheNextMemberWhenItsMemberStops) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd(3);
  std::unique_ptr<KvEngine> engine = Open(Options(*etcd));
  ASSERT_NE(engine, nullptr);
  Follower follower(engine.get());
  std::vector<int64_t> commits;
  auto commit = [&](const std::string& key) {
    absl::StatusOr<int64_t> r = engine->ApplyGuarded({Put(key, "1")}, {});
    EXPECT_TRUE(r.ok()) << key << ": " << r.status();
    if (r.ok()) commits.push_back(*r);
    return r.ok();
  };

  ASSERT_TRUE(commit("on-0"));
  ASSERT_TRUE(follower.AwaitRevision(commits.back()));
  EXPECT_EQ(etcd->calls(0, "Txn"), 1);
  EXPECT_EQ(etcd->calls(0, "Watch"), 1);

  etcd->Stop(0);
  ASSERT_TRUE(commit("on-1"));
  EXPECT_EQ(etcd->calls(1, "Txn"), 1);
  // Guarded commits are not retried on another member, but go to the one
  // the engine now uses.
  absl::StatusOr<int64_t> guarded = engine->ApplyGuarded(
      {Put("guarded", "1")}, {KvEngine::Guard{"guarded", 0}});
  ASSERT_TRUE(guarded.ok()) << guarded.status();
  commits.push_back(*guarded);
  EXPECT_EQ(etcd->calls(1, "Txn"), 2);
  ASSERT_TRUE(engine->ReadBarrier().ok());
  ASSERT_TRUE(engine->CheckWritable().ok());
  ASSERT_TRUE(follower.AwaitRevision(commits.back()));
  EXPECT_EQ(follower.Get("on-1"), "1");

  etcd->Stop(1);
  ASSERT_TRUE(commit("on-2"));
  EXPECT_EQ(etcd->calls(2, "Txn"), 1);
  // From the last member back to the first.
  ASSERT_TRUE(etcd->Restart(0).ok());
  etcd->Stop(2);
  absl::StatusOr<int64_t> back;
  const absl::Time give_up = absl::Now() + kPatience;
  do {
    // Member 0's channel may still be backing off from its stop.
    back = engine->ApplyGuarded({Put("on-0-again", "1")}, {});
  } while (!back.ok() && absl::Now() < give_up && Pause());
  ASSERT_TRUE(back.ok()) << back.status();
  commits.push_back(*back);
  ASSERT_TRUE(follower.AwaitRevision(commits.back()));
  EXPECT_EQ(follower.Get("on-0-again"), "1");

  // The watch moved with the members, and resumed each time after the
  // last revision it delivered: every commit once, in order.
  EXPECT_GE(etcd->calls(1, "Watch") + etcd->calls(2, "Watch"), 1);
  std::vector<int64_t> delivered = follower.revisions();
  delivered.erase(delivered.begin());  // The load's "whole" report.
  EXPECT_EQ(delivered, commits);
}

TEST(EtcdEngineTest, OpeningWithEveryMemberDownIsUnavailable) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd(2);
  etcd->Stop(0);
  etcd->Stop(1);
  EtcdEngineOptions options = Options(*etcd);
  options.connect_timeout = absl::Milliseconds(500);
  absl::StatusOr<std::unique_ptr<KvEngine>> engine = OpenEtcdEngine(options);
  ASSERT_EQ(engine.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(engine.status().message(),
              HasSubstr(absl::StrCat("no etcd member of ", etcd->endpoint(0),
                                     ",", etcd->endpoint(1),
                                     " gave the keys under /cohort/kv/")));
}

TEST(EtcdEngineTest, EveryMemberDownFailsCallsClearlyUntilOneReturns) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd(2);
  std::unique_ptr<KvEngine> engine = Open(Options(*etcd));
  ASSERT_NE(engine, nullptr);
  Follower follower(engine.get());
  ASSERT_TRUE(engine->ApplyGuarded({Put("before", "1")}, {}).ok());

  etcd->Stop(0);
  etcd->Stop(1);
  absl::StatusOr<int64_t> plain = engine->ApplyGuarded({Put("k", "1")}, {});
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(plain.status().message(), HasSubstr("etcd transaction: "));
  absl::StatusOr<int64_t> guarded =
      engine->ApplyGuarded({Put("k", "1")}, {KvEngine::Guard{"k", 0}});
  EXPECT_EQ(guarded.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(guarded.status().message(),
              HasSubstr("it may or may not have been applied"));
  absl::StatusOr<int64_t> barrier = engine->ReadBarrier();
  EXPECT_EQ(barrier.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(barrier.status().message(), HasSubstr("etcd read barrier: "));
  absl::Status writable = engine->CheckWritable();
  EXPECT_EQ(writable.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(writable.message(), HasSubstr("etcd has no quorum"));
  EXPECT_FALSE(etcd->Get("/cohort/kv/k").has_value());

  // Written while no member serves the engine: the watch brings it once
  // one does again.
  absl::StatusOr<int64_t> meanwhile = etcd->Put("/cohort/kv/meanwhile", "1");
  ASSERT_TRUE(meanwhile.ok());
  ASSERT_TRUE(etcd->Restart(1).ok());
  ASSERT_TRUE(follower.AwaitRevision(*meanwhile));
  EXPECT_EQ(follower.Get("meanwhile"), "1");
  absl::StatusOr<int64_t> after;
  const absl::Time give_up = absl::Now() + kPatience;
  do {
    after = engine->ApplyGuarded({Put("after", "1")}, {});
  } while (!after.ok() && absl::Now() < give_up && Pause());
  ASSERT_TRUE(after.ok()) << after.status();
  ASSERT_TRUE(follower.AwaitRevision(*after));
  EXPECT_EQ(follower.Get("after"), "1");
}

TEST(EtcdEngineTest, PrefixesAreIsolated) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  std::unique_ptr<KvEngine> one = Open(Options(*etcd, "/job1/"));
  ASSERT_NE(one, nullptr);
  std::unique_ptr<KvEngine> two = Open(Options(*etcd, "/job2/"));
  ASSERT_NE(two, nullptr);
  Follower follow_one(one.get());
  Follower follow_two(two.get());

  absl::StatusOr<int64_t> by_one = one->ApplyGuarded({Put("k", "one")}, {});
  ASSERT_TRUE(by_one.ok()) << by_one.status();
  absl::StatusOr<int64_t> by_two = two->ApplyGuarded({Put("k", "two")}, {});
  ASSERT_TRUE(by_two.ok()) << by_two.status();
  for (const char* beside : {"/job1", "/job10/k", "/job", "/job2/other"}) {
    ASSERT_TRUE(etcd->Put(beside, "x").ok());
  }
  ASSERT_TRUE(etcd->Put("/job1/last", "x").ok());
  absl::StatusOr<int64_t> last = etcd->Put("/job2/last", "x");
  ASSERT_TRUE(last.ok());

  ASSERT_TRUE(follow_one.AwaitRevision(*last - 1));
  ASSERT_TRUE(follow_two.AwaitRevision(*last));
  EXPECT_THAT(follow_one.Keys(), ElementsAre("k", "last"));
  EXPECT_EQ(follow_one.Get("k"), "one");
  EXPECT_THAT(follow_two.Keys(), ElementsAre("k", "last", "other"));
  EXPECT_EQ(follow_two.Get("k"), "two");
  std::vector<std::string> seen_by_one;
  for (const Follower::Entry& e : follow_one.entries()) {
    seen_by_one.insert(seen_by_one.end(), e.changes.begin(), e.changes.end());
  }
  EXPECT_THAT(seen_by_one, ElementsAre("put k=one", "put last=x"));
  // Each prefix keeps its own barrier.
  EXPECT_EQ(one->ReadBarrier().value_or(-1), *by_one);
  EXPECT_EQ(two->ReadBarrier().value_or(-1), *by_two);
}

// A replica's watch first replays the history etcd still holds from
// before its load (so that a store watch can resume from it there too),
// then reports once that the replay is whole. The reserved key of the
// read barrier is not a key of the view.
TEST(EtcdEngineTest, ReplaysTheHistoryBeforeTheLoadThenSaysItIsWhole) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  std::unique_ptr<KvEngine> writer = Open(Options(*etcd));
  ASSERT_NE(writer, nullptr);
  const std::vector<int64_t> commits = CommitEach(*writer, {"a", "b", "c"});
  ASSERT_EQ(commits.size(), 3);

  std::unique_ptr<KvEngine> engine = Open(Options(*etcd));
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->NumKeys(), 3);
  const int64_t loaded = engine->revision();
  ASSERT_EQ(loaded, commits.back());
  Follower follower(engine.get());
  absl::StatusOr<int64_t> next = writer->ApplyGuarded({Put("d", "1")}, {});
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE(follower.AwaitRevision(*next));
  std::vector<Follower::Entry> feed = follower.entries();
  ASSERT_EQ(feed.size(), 5);
  EXPECT_EQ(feed[0].revision, commits[0]);
  EXPECT_THAT(feed[0].changes, ElementsAre("put a=1"));
  EXPECT_EQ(feed[1].revision, commits[1]);
  EXPECT_EQ(feed[2].revision, commits[2]);
  EXPECT_EQ(feed[3].revision, loaded);  // Whole.
  EXPECT_TRUE(feed[3].changes.empty());
  EXPECT_EQ(feed[4].revision, *next);
  EXPECT_THAT(feed[4].changes, ElementsAre("put d=1"));
}

TEST(EtcdEngineTest, ReplaysOnlyHistoryRevisionsBack) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  std::unique_ptr<KvEngine> writer = Open(Options(*etcd));
  ASSERT_NE(writer, nullptr);
  ASSERT_EQ(CommitEach(*writer, {"a", "b", "c"}).size(), 3);
  EtcdEngineOptions options = Options(*etcd);
  options.history_revisions = 1;
  std::unique_ptr<KvEngine> engine = Open(options);
  ASSERT_NE(engine, nullptr);
  const int64_t loaded = engine->revision();
  Follower follower(engine.get());
  absl::StatusOr<int64_t> next = writer->ApplyGuarded({Put("d", "1")}, {});
  ASSERT_TRUE(next.ok());
  ASSERT_TRUE(follower.AwaitRevision(*next));
  std::vector<Follower::Entry> feed = follower.entries();
  ASSERT_EQ(feed.size(), 3);
  EXPECT_EQ(feed[0].revision, loaded);
  EXPECT_THAT(feed[0].changes, ElementsAre("put c=1"));
  EXPECT_EQ(feed[1].revision, loaded);
  EXPECT_TRUE(feed[1].changes.empty());
  EXPECT_EQ(feed[2].revision, *next);
}

// etcd compacted part of the history to replay: the watch replays what
// etcd still holds, and the replay is whole all the same.
TEST(EtcdEngineTest, ReplaysFromTheCompactionWhenHistoryIsCompacted) {
  std::unique_ptr<FakeEtcd> etcd = StartEtcd();
  std::unique_ptr<KvEngine> writer = Open(Options(*etcd));
  ASSERT_NE(writer, nullptr);
  const std::vector<int64_t> commits = CommitEach(*writer, {"a", "b", "c"});
  ASSERT_EQ(commits.size(), 3);
  etcd->Compact(commits[1]);

  std::unique_ptr<KvEngine> engine = Open(Options(*etcd));
  ASSERT_NE(engine, nullptr);
  Follower follower(engine.get());
  absl::StatusOr<int64_t> next = writer->ApplyGuarded({Put("d", "1")}, {});
  ASSERT_TRUE(next.ok());
  ASSERT_TRUE(follower.AwaitRevision(*next));
  std::vector<Follower::Entry> feed = follower.entries();
  ASSERT_EQ(feed.size(), 4);
  EXPECT_EQ(feed[0].revision, commits[1]);
  EXPECT_THAT(feed[0].changes, ElementsAre("put b=1"));
  EXPECT_EQ(feed[1].revision, commits[2]);
  EXPECT_EQ(feed[2].revision, commits[2]);  // Whole.
  EXPECT_TRUE(feed[2].changes.empty());
  EXPECT_EQ(feed[3].revision, *next);
  // Twice on the one member: the compacted watch, then the replay.
  EXPECT_EQ(etcd->calls(0, "Watch"), 2);
}

}  // namespace
}  // namespace cohort::server

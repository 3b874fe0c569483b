#include "server/coordination/rendezvous.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/c10d/rules.h"
#include "store/counting_engine.h"
#include "store/kv_engine.h"

namespace cohort::server {
namespace {

using ::testing::HasSubstr;

// One pending join and its outcome.
struct Joiner {
  absl::Notification done;
  absl::StatusOr<v1::JoinResponse> result;
};

class RendezvousTest : public ::testing::Test {
 protected:
  v1::JoinRequest Request(const std::string& node, int min, int max,
                          int local = 2) {
    v1::JoinRequest req;
    req.set_run_id("job");
    req.set_node_id(node);
    req.set_address(node + ".example:1");
    req.set_local_world_size(local);
    req.set_min_nodes(min);
    req.set_max_nodes(max);
    // Ten minutes: no join here ends by timing out unless its test says
    // so, however slowly the test runs.
    req.set_join_timeout_ms(10 * 60 * 1000);
    req.set_last_call_timeout_ms(100);
    return req;
  }

  Joiner& Join(const v1::JoinRequest& req, Rendezvous::JoinId* id = nullptr) {
    auto& j = joiners_.emplace_back(std::make_unique<Joiner>());
    Joiner* raw = j.get();
    Rendezvous::JoinId joined =
        rdzv_.Join(req, [raw](absl::StatusOr<v1::JoinResponse> r) {
          raw->result = std::move(r);
          raw->done.Notify();
        });
    if (id != nullptr) *id = joined;
    return *raw;
  }

  // Joiners outlive the rendezvous, which fails pending joins on exit.
  std::vector<std::unique_ptr<Joiner>> joiners_;
  store::KvStore store_{store::NewMemoryEngine()};
  Rendezvous rdzv_{&store_};
};

TEST_F(RendezvousTest, CompletesAtMaxNodesWithDistinctRanks) {
  // A last call that outlasts the test: only the third node completes it.
  auto request = [&](const std::string& node, int local) {
    v1::JoinRequest req = Request(node, 2, 3, local);
    req.set_last_call_timeout_ms(10 * 60 * 1000);
    return req;
  };
  Joiner& c = Join(request("c", 1));
  Joiner& a = Join(request("a", 2));
  EXPECT_FALSE(a.done.HasBeenNotified());
  EXPECT_EQ(rdzv_.stats().waiting_nodes, 2u);
  EXPECT_EQ(rdzv_.stats().rounds_completed, 0u);
  Joiner& b = Join(request("b", 4));
  for (Joiner* j : {&a, &b, &c}) {
    ASSERT_TRUE(j->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
    ASSERT_TRUE(j->result.ok()) << j->result.status();
    EXPECT_EQ(j->result->round(), 0);
    EXPECT_EQ(j->result->num_nodes(), 3);
    EXPECT_EQ(j->result->world_size(), 7);
    EXPECT_EQ(j->result->participants_size(), 3);
    EXPECT_EQ(j->result->store_prefix(), "runs/job/0");
  }
  // Node ranks follow node ids; global ranks are contiguous per node.
  EXPECT_EQ(a.result->node_rank(), 0);
  EXPECT_EQ(a.result->first_global_rank(), 0);
  EXPECT_EQ(b.result->node_rank(), 1);
  EXPECT_EQ(b.result->first_global_rank(), 2);
  EXPECT_EQ(c.result->node_rank(), 2);
  EXPECT_EQ(c.result->first_global_rank(), 6);
  EXPECT_EQ(a.result->participants(2).address(), "c.example:1");
  const RendezvousStats stats = rdzv_.stats();
  EXPECT_EQ(stats.rounds_completed, 1u);
  EXPECT_EQ(stats.waiting_nodes, 0u);
  EXPECT_EQ(stats.runs, 1u);
}

TEST_F(RendezvousTest, CompletesAfterLastCallWithMinNodes) {
  const absl::Time start = absl::Now();
  Joiner& a = Join(Request("a", 2, 4));
  Joiner& b = Join(Request("b", 2, 4));
  ASSERT_TRUE(a.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(b.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(a.result->num_nodes(), 2);
  EXPECT_EQ(b.result->world_size(), 4);
}

TEST_F(RendezvousTest, JoinTimeoutSaysHowManyArrived) {
  v1::JoinRequest req = Request("lonely", 3, 3);
  req.set_join_timeout_ms(50);
  Joiner& j = Join(req);
  ASSERT_TRUE(j.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(j.result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(j.result.status().message(),
              HasSubstr("1 of min_nodes=3 nodes arrived (lonely)"));
}

TEST_F(RendezvousTest, LateJoinerWaitsForTheNextRound) {
  Joiner& a = Join(Request("a", 2, 2));
  Joiner& b = Join(Request("b", 2, 2));
  ASSERT_TRUE(b.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(a.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  Joiner& late = Join(Request("c", 2, 2));
  absl::StatusOr<v1::RunState> state = rdzv_.GetRunState("job");
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->phase(), v1::RunState::COMPLETE);
  EXPECT_EQ(state->round(), 0);
  EXPECT_EQ(state->num_waiting(), 1);
  EXPECT_FALSE(late.done.HasBeenNotified());
  // One node of round 0 re-joins to let it in.
  Joiner& again = Join(Request("a", 2, 2));
  ASSERT_TRUE(late.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(again.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(late.result->round(), 1);
  EXPECT_EQ(late.result->node_rank(), 1);
  EXPECT_EQ(late.result->store_prefix(), "runs/job/1");
}

TEST_F(RendezvousTest, ClosedRunRejectsJoins) {
  Joiner& pending = Join(Request("a", 2, 2));
  ASSERT_TRUE(rdzv_.CloseRun("job").ok());
  ASSERT_TRUE(pending.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(pending.result.status().code(),
            absl::StatusCode::kFailedPrecondition);
  Joiner& late = Join(Request("b", 2, 2));
  EXPECT_EQ(late.result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.result.status().message(), HasSubstr("closed"));
}

TEST_F(RendezvousTest, RunIdsListsRecordedAndCollectingRuns) {
  EXPECT_TRUE(rdzv_.RunIds().empty());
  Join(Request("a", 1, 1));
  v1::JoinRequest other = Request("x", 2, 2);
  other.set_run_id("another");
  Join(other);
  EXPECT_THAT(rdzv_.RunIds(), ::testing::ElementsAre("another", "job"));
  Rendezvous reloaded(&store_);
  EXPECT_THAT(reloaded.RunIds(), ::testing::ElementsAre("job"));
}

TEST_F(RendezvousTest, BadRequestsAndConfigMismatch) {
  EXPECT_EQ(Join(Request("", 1, 1)).result.status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Join(Request("a", 3, 2)).result.status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Join(Request("a", 1, 1, 0)).result.status().code(),
            absl::StatusCode::kInvalidArgument);
  Join(Request("a", 2, 3));
  Joiner& other = Join(Request("b", 2, 4));
  EXPECT_EQ(other.result.status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.result.status().message(), HasSubstr("2:3"));
}

// Two joins of 2^31-1 processes each once made a world of -2.
TEST_F(RendezvousTest, WorldSizesThatWouldOverflowAreRefused) {
  Joiner& huge = Join(Request("a", 2, 2, 2147483647));
  EXPECT_EQ(huge.result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.result.status().message(),
              HasSubstr("local_world_size must be 1 to 65536"));

  // Within the per-node bound, the sum is bounded too.
  std::vector<Joiner*> ok;
  for (int i = 0; i < 256; ++i) {
    ok.push_back(&Join(Request(absl::StrCat("n", 1000 + i), 300, 300, 65536)));
  }
  Joiner& over = Join(Request("z", 300, 300, 65536));
  ASSERT_TRUE(over.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(over.result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      over.result.status().message(),
      HasSubstr("a world of 16842752 ranks, over the limit of 16777216"));
  for (Joiner* j : ok) EXPECT_FALSE(j->done.HasBeenNotified());
}

TEST_F(RendezvousTest, CompletedRoundsSurviveARestart) {
  Join(Request("a", 1, 1));
  ASSERT_TRUE(
      joiners_.back()->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  Rendezvous reloaded(&store_);
  absl::StatusOr<v1::RunState> state = reloaded.GetRunState("job");
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->phase(), v1::RunState::COMPLETE);
  EXPECT_EQ(state->participants(0).node_id(), "a");
  absl::Notification done;
  absl::StatusOr<v1::JoinResponse> next;
  reloaded.Join(Request("a", 1, 1), [&](absl::StatusOr<v1::JoinResponse> r) {
    next = std::move(r);
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(next->round(), 1);
}

v1::ListParticipantsRequest Page(int page_size, const std::string& token) {
  v1::ListParticipantsRequest req;
  req.set_run_id("job");
  req.set_page_size(page_size);
  req.set_page_token(token);
  return req;
}

// A round too large for JoinResponse: every node reads the list in pages.
TEST_F(RendezvousTest, ListParticipantsPagesThroughALargeRound) {
  const int n = Rendezvous::kMaxInlineParticipants + 44;  // 300
  for (int i = 0; i < n; ++i) Join(Request(absl::StrCat("n", 1000 + i), n, n));
  for (auto& j : joiners_) {
    ASSERT_TRUE(j->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
    ASSERT_TRUE(j->result.ok()) << j->result.status();
    EXPECT_EQ(j->result->participants_size(), 0);
    EXPECT_EQ(j->result->num_nodes(), n);
  }
  std::vector<std::string> listed;
  std::string token;
  int pages = 0;
  do {
    absl::StatusOr<v1::ListParticipantsResponse> page =
        rdzv_.ListParticipants(Page(128, token));
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_EQ(page->round(), 0);
    EXPECT_EQ(page->num_nodes(), n);
    EXPECT_LE(page->participants_size(), 128);
    for (const v1::Participant& p : page->participants()) {
      EXPECT_EQ(p.node_rank(), static_cast<int>(listed.size()));
      EXPECT_EQ(p.first_global_rank(), 2 * p.node_rank());
      listed.push_back(p.node_id());
    }
    token = page->next_page_token();
    ++pages;
  } while (!token.empty());
  EXPECT_EQ(pages, 3);
  ASSERT_EQ(listed.size(), static_cast<size_t>(n));
  EXPECT_EQ(listed.front(), "n1000");
  EXPECT_EQ(listed.back(), absl::StrCat("n", 1000 + n - 1));

  // Page size 0 is the default (1000): one page.
  absl::StatusOr<v1::ListParticipantsResponse> all =
      rdzv_.ListParticipants(Page(0, ""));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->participants_size(), n);
  EXPECT_TRUE(all->next_page_token().empty());
}

TEST_F(RendezvousTest, ListParticipantsErrors) {
  EXPECT_EQ(rdzv_.ListParticipants(Page(0, "")).status().code(),
            absl::StatusCode::kNotFound);
  Joiner& a = Join(Request("a", 2, 2));
  absl::StatusOr<v1::ListParticipantsResponse> collecting =
      rdzv_.ListParticipants(Page(0, ""));
  EXPECT_EQ(collecting.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(collecting.status().message(), HasSubstr("still collecting"));
  Join(Request("b", 2, 2));
  ASSERT_TRUE(a.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(rdzv_.ListParticipants(Page(-1, "")).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const char* bad : {"junk", "0:0", "0:2", "1:1", "0:-1", ":1"}) {
    EXPECT_EQ(rdzv_.ListParticipants(Page(1, bad)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  absl::StatusOr<v1::ListParticipantsResponse> first =
      rdzv_.ListParticipants(Page(1, ""));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->participants(0).node_id(), "a");
  ASSERT_EQ(first->next_page_token(), "0:1");

  // Round 1 completes before the second page is read.
  Joiner& a1 = Join(Request("a", 2, 2));
  Joiner& b1 = Join(Request("b", 2, 2));
  ASSERT_TRUE(a1.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(b1.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  absl::StatusOr<v1::ListParticipantsResponse> stale =
      rdzv_.ListParticipants(Page(1, first->next_page_token()));
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(stale.status().message(),
              HasSubstr("completed round 1 while the participants of round 0 "
                        "were being listed"));

  // A closed run still lists its last round.
  ASSERT_TRUE(rdzv_.CloseRun("job").ok());
  absl::StatusOr<v1::ListParticipantsResponse> closed =
      rdzv_.ListParticipants(Page(0, ""));
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(closed->round(), 1);
  EXPECT_EQ(closed->participants_size(), 2);
}

TEST_F(RendezvousTest, CancelledJoinLeavesTheRound) {
  Rendezvous::JoinId a_id = 0;
  Joiner& a = Join(Request("a", 3, 3, 4), &a_id);
  Joiner& b = Join(Request("b", 3, 3, 4));
  ASSERT_NE(a_id, 0u);
  rdzv_.CancelJoin(a_id);
  rdzv_.CancelJoin(a_id);  // Twice: the second finds nothing.
  EXPECT_EQ(rdzv_.stats().waiting_nodes, 1u);
  EXPECT_FALSE(a.done.HasBeenNotified());
  // The cancelled node's ranks no longer count towards the world.
  Joiner& c = Join(Request("c", 3, 3, 1));
  Joiner& d = Join(Request("d", 3, 3, 1));
  ASSERT_TRUE(b.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(c.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(d.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(b.result.ok()) << b.result.status();
  EXPECT_EQ(b.result->num_nodes(), 3);
  EXPECT_EQ(b.result->world_size(), 6);
  EXPECT_EQ(b.result->node_rank(), 0);
}

TEST_F(RendezvousTest, GetRunStateCanOmitParticipants) {
  Join(Request("a", 2, 2));
  v1::GetRunStateRequest req;
  req.set_run_id("job");
  absl::StatusOr<v1::RunState> collecting = rdzv_.GetRunState(req);
  ASSERT_TRUE(collecting.ok()) << collecting.status();
  EXPECT_EQ(collecting->num_participants(), 1);
  EXPECT_EQ(collecting->participants_size(), 1);
  Join(Request("b", 2, 2));
  Join(Request("c", 2, 2));  // Waits for round 1.
  req.set_omit_participants(true);
  absl::StatusOr<v1::RunState> complete = rdzv_.GetRunState(req);
  ASSERT_TRUE(complete.ok()) << complete.status();
  EXPECT_EQ(complete->phase(), v1::RunState::COMPLETE);
  EXPECT_EQ(complete->num_participants(), 2);
  EXPECT_EQ(complete->participants_size(), 0);
  EXPECT_EQ(complete->num_waiting(), 1);
  EXPECT_EQ(complete->max_nodes(), 2);
}

v1::GetParticipantsRequest Ranges(
    std::initializer_list<std::pair<int, int>> ranges) {
  v1::GetParticipantsRequest req;
  req.set_run_id("job");
  for (auto [start, end] : ranges) {
    v1::NodeRankRange* range = req.add_ranges();
    range->set_start_node_rank(start);
    range->set_end_node_rank(end);
  }
  return req;
}

// A node of a ring asks for its neighbours and the root, not all N.
TEST_F(RendezvousTest, GetParticipantsByNodeRank) {
  const int n = 300;
  for (int i = 0; i < n; ++i) Join(Request(absl::StrCat("n", 1000 + i), n, n));
  ASSERT_TRUE(
      joiners_.back()->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  v1::GetParticipantsRequest req = Ranges({{0, 1}, {41, 42}, {43, 44}});
  req.set_round(0);
  absl::StatusOr<v1::GetParticipantsResponse> ring = rdzv_.GetParticipants(req);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_EQ(ring->round(), 0);
  EXPECT_EQ(ring->num_nodes(), n);
  ASSERT_EQ(ring->participants_size(), 3);
  EXPECT_EQ(ring->participants(0).node_id(), "n1000");
  EXPECT_EQ(ring->participants(1).node_id(), "n1041");
  EXPECT_EQ(ring->participants(1).first_global_rank(), 82);
  EXPECT_EQ(ring->participants(2).node_rank(), 43);
  EXPECT_EQ(ring->participants(2).address(), "n1043.example:1");

  // The wrap-around neighbour and the whole round.
  absl::StatusOr<v1::GetParticipantsResponse> wrap =
      rdzv_.GetParticipants(Ranges({{n - 1, n}, {0, n}}));
  ASSERT_TRUE(wrap.ok()) << wrap.status();
  ASSERT_EQ(wrap->participants_size(), n + 1);
  EXPECT_EQ(wrap->participants(0).node_rank(), n - 1);
  EXPECT_EQ(wrap->participants(n).node_rank(), n - 1);

  // At most 10,000 participants a call: 34 times all 300 is 10,200.
  v1::GetParticipantsRequest too_many;
  for (int i = 0; i < 34; ++i) too_many.MergeFrom(Ranges({{0, n}}));
  absl::StatusOr<v1::GetParticipantsResponse> refused =
      rdzv_.GetParticipants(too_many);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("ranges ask for 10200 participants, more than the "
                        "10000 one call returns"));
}

TEST_F(RendezvousTest, GetParticipantsErrors) {
  EXPECT_EQ(rdzv_.GetParticipants(Ranges({{0, 1}})).status().code(),
            absl::StatusCode::kNotFound);
  Joiner& a = Join(Request("a", 2, 2));
  EXPECT_EQ(rdzv_.GetParticipants(Ranges({{0, 1}})).status().code(),
            absl::StatusCode::kFailedPrecondition);
  Join(Request("b", 2, 2));
  ASSERT_TRUE(a.done.WaitForNotificationWithTimeout(absl::Seconds(5)));

  auto message = [&](const v1::GetParticipantsRequest& req) {
    absl::StatusOr<v1::GetParticipantsResponse> r = rdzv_.GetParticipants(req);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(r.status().message());
  };
  EXPECT_THAT(message(Ranges({})), HasSubstr("ranges is empty"));
  EXPECT_THAT(message(Ranges({{0, 1}, {1, 1}})),
              HasSubstr("range 1 [1, 1) of run 'job' is not a non-empty "
                        "range of its 2 node ranks: need 0 <= "
                        "start_node_rank < end_node_rank <= 2"));
  EXPECT_THAT(message(Ranges({{-1, 1}})), HasSubstr("range 0 [-1, 1)"));
  EXPECT_THAT(message(Ranges({{1, 3}})), HasSubstr("range 0 [1, 3)"));
  v1::GetParticipantsRequest many;
  for (int i = 0; i < 65; ++i) many.MergeFrom(Ranges({{0, 1}}));
  EXPECT_THAT(message(many), HasSubstr("at most 64 ranges, got 65"));
  v1::GetParticipantsRequest stale = Ranges({{0, 1}});
  stale.set_round(7);
  absl::StatusOr<v1::GetParticipantsResponse> r = rdzv_.GetParticipants(stale);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(r.status().message(),
              HasSubstr("has completed round 0, not round 7: join again"));
}

// The work one join costs, counted rather than timed: store writes, keys
// rewritten, bytes serialized and nodes visited per node must not grow
// with the round. A join that summed or searched the round (as Join's
// world-size check and CancelJoin once did) makes a round quadratic.
struct RoundWork {
  store::EngineWork engine;
  RendezvousStats stats;
  uint64_t lookup_bytes = 0;  // GetParticipants replies: ring + root.
};

RoundWork OneRound(int n) {
  auto counting =
      std::make_unique<store::CountingEngine>(store::NewMemoryEngine());
  store::CountingEngine* engine = counting.get();
  store::KvStore store(std::move(counting));
  Rendezvous rdzv(&store);
  const store::EngineWork before = engine->work();
  int answered = 0;
  auto request = [n](int i) {
    v1::JoinRequest req;
    req.set_run_id("job");
    // Fixed widths, so that every node's own bytes are the same.
    req.set_node_id(absl::StrFormat("node-%06d", i));
    req.set_address(absl::StrFormat("10.%03d.%03d.1:29400", i / 256, i % 256));
    req.set_local_world_size(8);
    req.set_min_nodes(n);
    req.set_max_nodes(n);
    req.set_join_timeout_ms(10 * 60 * 1000);
    return req;
  };
  auto done = [&answered](absl::StatusOr<v1::JoinResponse> r) {
    EXPECT_TRUE(r.ok()) << r.status();
    ++answered;
  };
  for (int i = 0; i < n; ++i) {
    // Every fourth node gives up once and joins again.
    if (i % 4 == 1) rdzv.CancelJoin(rdzv.Join(request(i), done));
    rdzv.Join(request(i), done);
  }
  EXPECT_EQ(answered, n);
  RoundWork work;
  work.engine = engine->work() - before;
  work.stats = rdzv.stats();
  for (int i = 0; i < n; ++i) {
    v1::GetParticipantsRequest req;
    req.set_run_id("job");
    for (int r : {0, (i + n - 1) % n, (i + 1) % n}) {
      v1::NodeRankRange* range = req.add_ranges();
      range->set_start_node_rank(r);
      range->set_end_node_rank(r + 1);
    }
    absl::StatusOr<ParticipantsReply> reply = rdzv.GetParticipantsBytes(req);
    EXPECT_TRUE(reply.ok()) << reply.status();
    if (reply.ok()) work.lookup_bytes += reply->size();
  }
  return work;
}

TEST(RendezvousWorkTest, WorkPerJoinDoesNotGrowWithTheRound) {
  const RoundWork small = OneRound(1000);
  const RoundWork large = OneRound(4000);
  // One write completes a round, whatever its size; no join reads.
  for (const RoundWork* w : {&small, &large}) {
    EXPECT_EQ(w->engine.applies, 1u);
    EXPECT_EQ(w->engine.mutations, 1u);
    EXPECT_EQ(w->engine.gets, 0u);
    EXPECT_EQ(w->stats.rounds_completed, 1u);
  }
  // Every node is visited the same number of times (its completion).
  EXPECT_EQ(large.stats.node_visits * 1000, small.stats.node_visits * 4000);
  // Bytes per node: a node's own fields are the same at both sizes, but
  // rank-valued varints (node_rank, first_global_rank, world_size,
  // num_nodes) take a byte more past 2^7 and 2^14. Going from 1,000 to
  // 4,000 nodes of 8 ranks (world 8,000 to 32,000) each of the four gains
  // at most one byte, so a node's bytes grow by at most 4, plus the
  // share of a round's constant bytes (the run's record header, the
  // key), which only shrinks.
  constexpr double kVarintGrowth = 4;
  auto per_node = [](uint64_t bytes, int n) {
    return static_cast<double>(bytes) / n;
  };
  EXPECT_LE(per_node(large.engine.bytes_written, 4000),
            per_node(small.engine.bytes_written, 1000) + kVarintGrowth);
  EXPECT_LE(per_node(large.stats.bytes_serialized, 4000),
            per_node(small.stats.bytes_serialized, 1000) + kVarintGrowth);
  EXPECT_LE(per_node(large.stats.join_response_bytes, 4000),
            per_node(small.stats.join_response_bytes, 1000) + kVarintGrowth);
  EXPECT_LE(per_node(large.lookup_bytes, 4000),
            per_node(small.lookup_bytes, 1000) + 3 * kVarintGrowth);
  // And none of it is an N-entry list per node: a JoinResponse of a large
  // round carries no participants.
  EXPECT_LT(per_node(large.stats.join_response_bytes, 4000), 100);
}

TEST_F(RendezvousTest, RunRecordsAreInTheReservedNamespace) {
  EXPECT_TRUE(
      absl::StartsWith(Rendezvous::RunKey("job"), c10d::kReservedPrefix));
}

}  // namespace
}  // namespace cohort::server

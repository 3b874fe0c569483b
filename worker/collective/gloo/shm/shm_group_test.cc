// Forks real local ranks that share one segment, rendezvousing through a
// FileStore in the test's temporary directory.
#include "worker/collective/gloo/shm/shm_group.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/collective/gloo/shm/local_ranks.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

using testing::ExpectAllOk;
using testing::Fork;
using testing::Local;
using testing::NamesOf;

absl::StatusOr<std::unique_ptr<ShmGroup>> Join(
    const Local& l, absl::Duration timeout = absl::Seconds(30),
    size_t slot_bytes = 4096) {
  ShmGroupOptions options;
  options.timeout = timeout;
  options.slot_bytes = slot_bytes;
  return ShmGroup::Create(*l.store, "shm", l.rank, l.size, options);
}

template <typename T>
absl::Status Expect(absl::string_view what, const std::vector<T>& actual,
                    const std::vector<T>& expected) {
  if (actual == expected) return absl::OkStatus();
  for (size_t i = 0; i < std::min(actual.size(), expected.size()); ++i) {
    if (actual[i] != expected[i]) {
      return absl::InternalError(absl::StrCat(what, ": element ", i, " is ",
                                              actual[i], ", expected ",
                                              expected[i]));
    }
  }
  return absl::InternalError(absl::StrCat(
      what, ": ", actual.size(), " elements, expected ", expected.size()));
}

// rank r's value at i: distinct per (r, i), small enough for exact sums.
int32_t V(int r, size_t i) {
  return static_cast<int32_t>(r * 100003 + i % 9973);
}

template <typename T>
BufferView View(std::vector<T>& v) {
  return BufferView::Of(v.data(), v.size());
}

// Every op, with buffers of many 4 KiB rounds and ragged ends, against
// references computed here.
absl::Status EveryOp(const Local& l) {
  absl::StatusOr<std::unique_ptr<ShmGroup>> made = Join(l);
  if (!made.ok()) return made.status();
  ShmGroup& g = **made;
  const int n = l.size, me = l.rank;
  const std::string check = "same everywhere";

  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
    constexpr size_t kCount = 5000;  // 20000 bytes: 5 rounds.
    std::vector<int32_t> data(kCount), expected(kCount);
    for (size_t i = 0; i < kCount; ++i) {
      data[i] = V(me, i);
      expected[i] = V(0, i);
      for (int r = 1; r < n; ++r) {
        expected[i] = op == ReduceOp::kSum ? expected[i] + V(r, i)
                                           : std::max(expected[i], V(r, i));
      }
    }
    std::vector<int32_t> reduced = data;
    RETURN_IF_ERROR(g.Run(CollectiveOp::AllReduce(View(reduced), op), check));
    RETURN_IF_ERROR(Expect("AllReduce", reduced, expected));
    std::vector<int32_t> rooted = data;
    RETURN_IF_ERROR(
        g.Run(CollectiveOp::Reduce(View(rooted), n - 1, op), check));
    RETURN_IF_ERROR(Expect("Reduce", rooted, me == n - 1 ? expected : data));
  }

  std::vector<double> cast(2500);  // 20000 bytes.
  for (size_t i = 0; i < cast.size(); ++i) cast[i] = me == 1 ? i * 0.5 : -1;
  RETURN_IF_ERROR(g.Run(CollectiveOp::Broadcast(View(cast), 1), check));
  for (size_t i = 0; i < cast.size(); ++i) {
    if (cast[i] != i * 0.5) return absl::InternalError("Broadcast differs");
  }

  constexpr size_t kEach = 3001;  // Not a multiple of anything.
  std::vector<int32_t> mine(kEach), gathered(kEach * n), expected_all;
  for (size_t i = 0; i < kEach; ++i) mine[i] = V(me, i);
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < kEach; ++i) expected_all.push_back(V(r, i));
  }
  RETURN_IF_ERROR(
      g.Run(CollectiveOp::AllGather(View(mine), View(gathered)), check));
  RETURN_IF_ERROR(Expect("AllGather", gathered, expected_all));
  std::vector<int32_t> to_root(me == 0 ? kEach * n : 0);
  RETURN_IF_ERROR(
      g.Run(CollectiveOp::Gather(View(mine), View(to_root), 0), check));
  if (me == 0) RETURN_IF_ERROR(Expect("Gather", to_root, expected_all));

  std::vector<int32_t> scattered(kEach);
  std::vector<int32_t> source = me == 0 ? expected_all : std::vector<int32_t>();
  RETURN_IF_ERROR(
      g.Run(CollectiveOp::Scatter(View(source), View(scattered), 0), check));
  RETURN_IF_ERROR(
      Expect("Scatter", scattered,
             std::vector<int32_t>(expected_all.begin() + me * kEach,
                                  expected_all.begin() + (me + 1) * kEach)));

  // AllToAll: block j of rank i lands in block i of rank j.
  std::vector<int32_t> blocks(kEach * n), swapped(kEach * n), want;
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < kEach; ++i)
      blocks[j * kEach + i] = V(me, j * kEach + i);
  }
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < kEach; ++i) want.push_back(V(r, me * kEach + i));
  }
  RETURN_IF_ERROR(
      g.Run(CollectiveOp::AllToAll(View(blocks), View(swapped)), check));
  RETURN_IF_ERROR(Expect("AllToAll", swapped, want));

  // ReduceScatter of f64: rank r gets the sum of every rank's block r.
  std::vector<double> rs_in(kEach * n), rs_out(kEach), rs_want(kEach);
  for (size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = V(me, i);
  for (size_t i = 0; i < kEach; ++i) {
    for (int r = 0; r < n; ++r) rs_want[i] += V(r, me * kEach + i);
  }
  RETURN_IF_ERROR(g.Run(
      CollectiveOp::ReduceScatter(View(rs_in), View(rs_out), ReduceOp::kSum),
      check));
  RETURN_IF_ERROR(Expect("ReduceScatter", rs_out, rs_want));

  // AllGatherV: rank r gives (r % 2 ? 0 : 1500 * (r + 1)) elements.
  std::vector<size_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = r % 2 ? 0 : 1500 * (r + 1);
  std::vector<int32_t> v_in(counts[me]), v_want;
  for (size_t i = 0; i < counts[me]; ++i) v_in[i] = V(me, i);
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < counts[r]; ++i) v_want.push_back(V(r, i));
  }
  std::vector<int32_t> v_out(v_want.size());
  RETURN_IF_ERROR(
      g.Run(CollectiveOp::AllGatherV(View(v_in), View(v_out), counts), check));
  RETURN_IF_ERROR(Expect("AllGatherV", v_out, v_want));

  // AllToAllV: rank i sends 700 * ((i + j) % 3) elements to rank j, so
  // some pairs need more rounds than others and some send nothing.
  auto count = [](int from, int to) -> size_t {
    return 700 * ((from + to) % 3);
  };
  std::vector<size_t> send_counts(n), recv_counts(n);
  std::vector<int32_t> send, recv_want;
  for (int j = 0; j < n; ++j) {
    send_counts[j] = count(me, j);
    recv_counts[j] = count(j, me);
    for (size_t i = 0; i < send_counts[j]; ++i)
      send.push_back(V(me, j * 10000 + i));
    for (size_t i = 0; i < recv_counts[j]; ++i)
      recv_want.push_back(V(j, me * 10000 + i));
  }
  std::vector<int32_t> recv(recv_want.size());
  RETURN_IF_ERROR(g.Run(
      CollectiveOp::AllToAllV(View(send), send_counts, View(recv), recv_counts),
      "AllToAllV"));
  RETURN_IF_ERROR(Expect("AllToAllV", recv, recv_want));
  return g.Run(CollectiveOp::Barrier(), "Barrier");
}

class ShmGroupTest : public ::testing::TestWithParam<int> {};

TEST_P(ShmGroupTest, EveryOpMatchesItsReferenceOverManyRounds) {
  ExpectAllOk(Fork(GetParam(), EveryOp));
}

INSTANTIATE_TEST_SUITE_P(LocalRanks, ShmGroupTest, ::testing::Values(2, 3, 4));

TEST(ShmGroupChecks, RanksThatDisagreeGetInvalidArgumentAndCarryOn) {
  ExpectAllOk(Fork(3, [](const Local& l) -> absl::Status {
    absl::StatusOr<std::unique_ptr<ShmGroup>> g = Join(l);
    if (!g.ok()) return g.status();
    // Rank 1 reduces 8 elements where the others reduce 4: everyone is told,
    // before any output is written.
    std::vector<int32_t> data(l.rank == 1 ? 8 : 4, 7);
    const CollectiveOp op = CollectiveOp::AllReduce(View(data), ReduceOp::kSum);
    absl::Status status = (*g)->Run(op, op.Name());
    const std::string named = l.rank == 1
                                  ? "rank 0 issued 'AllReduce SUM of 4 i32'"
                                  : "rank 1 issued 'AllReduce SUM of 8 i32'";
    if (status.code() != absl::StatusCode::kInvalidArgument ||
        !absl::StrContains(status.message(), named)) {
      return absl::InternalError(
          absl::StrCat("unexpected: ", status.ToString()));
    }
    for (int32_t x : data) {
      if (x != 7)
        return absl::InternalError("output written despite the check");
    }
    // The group is still usable.
    std::vector<int32_t> ok(4, l.rank);
    const CollectiveOp next = CollectiveOp::AllReduce(View(ok), ReduceOp::kSum);
    RETURN_IF_ERROR((*g)->Run(next, next.Name()));
    return Expect("after", ok, std::vector<int32_t>(4, 3));
  }));
}

TEST(ShmGroupFaults, APeerKilledMidOpIsSeenAtOnceAndNothingIsLeftInDevShm) {
  std::vector<pid_t> ranks;
  std::vector<int> statuses = Fork(
      3,
      [](const Local& l) -> absl::Status {
        // An op timeout that outlasts the test: only the liveness check can end
        // the op (UNAVAILABLE naming the dead rank; a timeout would be
        // DEADLINE_EXCEEDED).
        absl::StatusOr<std::unique_ptr<ShmGroup>> g =
            Join(l, absl::Minutes(10));
        if (!g.ok()) return g.status();
        // Every rank has mapped the segment: its name is already gone.
        std::vector<int32_t> one(1);
        RETURN_IF_ERROR(
            (*g)->Run(CollectiveOp::AllReduce(View(one), ReduceOp::kSum), ""));
        if (l.rank == 0 && !NamesOf(getpid()).empty()) {
          return absl::InternalError("the segment's name outlived the attach");
        }
        if (l.rank == 2) raise(SIGKILL);
        std::vector<int32_t> data(100000, 1);
        absl::Status status =
            (*g)->Run(CollectiveOp::AllReduce(View(data), ReduceOp::kSum), "");
        if (status.code() != absl::StatusCode::kUnavailable ||
            !absl::StrContains(status.message(), "rank 2 (pid")) {
          return absl::InternalError(
              absl::StrCat("unexpected: ", status.ToString()));
        }
        // The group stays failed.
        absl::Status after = (*g)->Run(CollectiveOp::Barrier(), "");
        if (after.code() != absl::StatusCode::kUnavailable) {
          return absl::InternalError(absl::StrCat("after: ", after.ToString()));
        }
        return absl::OkStatus();
      },
      {}, &ranks);
  ASSERT_EQ(statuses.size(), 3u);
  EXPECT_TRUE(WIFEXITED(statuses[0]) && WEXITSTATUS(statuses[0]) == 0);
  EXPECT_TRUE(WIFEXITED(statuses[1]) && WEXITSTATUS(statuses[1]) == 0);
  EXPECT_TRUE(WIFSIGNALED(statuses[2]) && WTERMSIG(statuses[2]) == SIGKILL);
  // The segment was created by one of these ranks, all gone now: no name
  // of theirs is left.
  for (pid_t pid : ranks) EXPECT_THAT(NamesOf(pid), ::testing::IsEmpty());
}

TEST(ShmGroupFaults, AStuckPeerTimesOutNamingIt) {
  ExpectAllOk(Fork(3, [](const Local& l) -> absl::Status {
    absl::StatusOr<std::unique_ptr<ShmGroup>> g = Join(l, absl::Seconds(1));
    if (!g.ok()) return g.status();
    const std::vector<std::string> timed_out = {"timed_out/0", "timed_out/1"};
    if (l.rank == 2) {
      // Alive, but never issues the op, until the others have timed out.
      return l.store->Wait(timed_out, absl::Minutes(10));
    }
    absl::Status status = (*g)->Run(CollectiveOp::Barrier(), "");
    RETURN_IF_ERROR(l.store->Set(timed_out[l.rank], "1"));
    if (status.code() != absl::StatusCode::kDeadlineExceeded ||
        !absl::StrContains(status.message(), "rank(s) 2 did not reach")) {
      return absl::InternalError(
          absl::StrCat("unexpected: ", status.ToString()));
    }
    return absl::OkStatus();
  }));
}

TEST(ShmGroupSpin, FourRanksOnFewerCoresStillProgress) {
  ExpectAllOk(Fork(4, [](const Local& l) -> absl::Status {
    absl::StatusOr<std::unique_ptr<ShmGroup>> g = Join(l, absl::Seconds(30));
    if (!g.ok()) return g.status();
    std::vector<float> data(256);
    for (int i = 0; i < 300; ++i) {
      std::fill(data.begin(), data.end(), 1.0f);
      RETURN_IF_ERROR(
          (*g)->Run(CollectiveOp::AllReduce(View(data), ReduceOp::kSum), "x"));
      if (data[0] != 4.0f) return absl::InternalError("wrong sum");
    }
    return absl::OkStatus();
  }));
}

}  // namespace
}  // namespace cohort

// NcclProcessGroup over the fake NCCL (fake_nccl_api.h): ranks are threads
// of this process, buffers host memory, the store an in-process one. What
// the GPU would compute is not tested here (nccl_gpu_test does, on a GPU);
// what cohort does around NCCL is: bootstrap, op validation and ordering,
// the calls each op makes, Work completion, the watchdog, error reporting.
#include "worker/collective/nccl/nccl_process_group.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"
#include "worker/collective/nccl/fake_nccl_api.h"

namespace cohort {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

NcclOptions TestOptions() {
  NcclOptions options;
  options.group.timeout = absl::Seconds(10);
  options.watchdog_interval = absl::Milliseconds(10);
  return options;
}

// `n` ranks on threads, each with its own fake api over one world.
class Ranks {
 public:
  explicit Ranks(int n, NcclOptions options = TestOptions())
      : n_(n), store_(std::make_shared<InProcessStore>()) {
    world_ = NewFakeNcclWorld();
    for (int r = 0; r < n; ++r) {
      apis_.push_back(std::make_shared<FakeNcclApi>(world_));
    }
    groups_.resize(n);
    created_.resize(n);
    RunAll([&](int r) {
      NcclOptions mine = options;
      mine.api = apis_[r];
      mine.error_reporter = [this, r](const absl::Status& s) {
        absl::MutexLock lock(&mu_);
        reports_.push_back({r, s});
      };
      absl::StatusOr<std::unique_ptr<NcclProcessGroup>> group =
          NcclProcessGroup::Create(store_, r, n_, mine);
      created_[r] = group.status();
      if (group.ok()) groups_[r] = std::move(*group);
    });
  }
  // The groups first: their watchdogs may still be reporting into reports_
  // (an abort is reported just after the op it failed returns).
  ~Ranks() { groups_.clear(); }

  // Runs fn(rank) on a thread per rank and joins them.
  void RunAll(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }

  bool ok() const {
    for (const auto& s : created_) {
      if (!s.ok()) return false;
    }
    return true;
  }
  const std::vector<absl::Status>& created() const { return created_; }
  NcclProcessGroup& group(int r) { return *groups_[r]; }
  FakeNcclApi& api(int r) { return *apis_[r]; }
  std::vector<std::pair<int, absl::Status>> reports() {
    absl::MutexLock lock(&mu_);
    return reports_;
  }
  // The reports once there are `n`: the watchdog reports an abort just
  // after the ops it failed see it. Gives up after 30 s (fewer come back).
  std::vector<std::pair<int, absl::Status>> AwaitReports(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return reports_.size() >= n;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
    return reports_;
  }

 private:
  const int n_;
  std::shared_ptr<InProcessStore> store_;
  std::shared_ptr<FakeNcclWorld> world_;
  std::vector<std::shared_ptr<FakeNcclApi>> apis_;
  std::vector<absl::Status> created_;
  std::vector<std::unique_ptr<NcclProcessGroup>> groups_;
  absl::Mutex mu_;
  std::vector<std::pair<int, absl::Status>> reports_ ABSL_GUARDED_BY(mu_);
};

TEST(NcclProcessGroup, WithoutAGpuCreateSaysNoCudaDeviceVisible) {
  auto world = NewFakeNcclWorld();
  NcclOptions options = TestOptions();
  options.api = std::make_shared<FakeNcclApi>(world, /*devices=*/0);
  absl::StatusOr<std::unique_ptr<NcclProcessGroup>> group =
      NcclProcessGroup::Create(std::make_shared<InProcessStore>(), 0, 1,
                               options);
  ASSERT_EQ(group.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(group.status().message(), HasSubstr("no CUDA device visible"));
  EXPECT_THAT(group.status().message(), HasSubstr("rank 0 of 1"));
}

TEST(NcclProcessGroup, RefusesBadArguments) {
  auto store = std::make_shared<InProcessStore>();
  NcclOptions options = TestOptions();
  EXPECT_THAT(NcclProcessGroup::Create(store, 0, 1, options).status().message(),
              HasSubstr("no NcclApi"));
  options.api = std::make_shared<FakeNcclApi>(NewFakeNcclWorld(), 2);
  EXPECT_EQ(NcclProcessGroup::Create(store, 2, 2, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.device = 2;
  absl::Status bad_device =
      NcclProcessGroup::Create(store, 0, 1, options).status();
  EXPECT_EQ(bad_device.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_device.message(), HasSubstr("device 2 is not one of the 2"));
}

TEST(NcclProcessGroup, EveryCollectiveMovesTheRightElements) {
  constexpr int kN = 4;
  Ranks ranks(kN);
  ASSERT_TRUE(ranks.ok()) << ranks.created()[0];
  ranks.RunAll([&](int r) {
    NcclProcessGroup& g = ranks.group(r);
    // AllReduce of every op.
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin,
                        ReduceOp::kMax, ReduceOp::kAvg}) {
      std::vector<float> x = {float(r + 1), float(2 * (r + 1))};
      ASSERT_TRUE(g.AllReduce(BufferView::Of(x.data(), 2), op)->Wait().ok());
      const float expected[] = {10, 24, 1, 4, 2.5};
      EXPECT_EQ(x[0], expected[static_cast<int>(op)]) << ReduceOpName(op);
    }
    // Broadcast from rank 2.
    std::vector<int32_t> b = {r, r};
    ASSERT_TRUE(g.Broadcast(BufferView::Of(b.data(), 2), 2)->Wait().ok());
    EXPECT_THAT(b, ElementsAre(2, 2));
    // Reduce to rank 1: the others keep theirs.
    std::vector<int64_t> red = {r + 1};
    ASSERT_TRUE(g.Reduce(BufferView::Of(red.data(), 1), 1, ReduceOp::kSum)
                    ->Wait()
                    .ok());
    EXPECT_EQ(red[0], r == 1 ? 10 : r + 1);
    // AllGather.
    std::vector<float> in = {float(r)}, out(kN);
    ASSERT_TRUE(g.AllGather(BufferView::Of(in.data(), 1),
                            BufferView::Of(out.data(), kN))
                    ->Wait()
                    .ok());
    EXPECT_THAT(out, ElementsAre(0, 1, 2, 3));
    // AllGatherV: rank r gives r + 1 elements.
    std::vector<size_t> counts = {1, 2, 3, 4};
    std::vector<float> vin(r + 1, float(r)), vout(10, -1);
    ASSERT_TRUE(g.AllGatherV(BufferView::Of(vin.data(), r + 1),
                             BufferView::Of(vout.data(), 10), counts)
                    ->Wait()
                    .ok());
    EXPECT_THAT(vout, ElementsAre(0, 1, 1, 2, 2, 2, 3, 3, 3, 3));
    // Gather to rank 3.
    std::vector<float> gout(kN, -1);
    ASSERT_TRUE(g.Gather(BufferView::Of(in.data(), 1),
                         BufferView::Of(gout.data(), kN), 3)
                    ->Wait()
                    .ok());
    if (r == 3) {
      EXPECT_THAT(gout, ElementsAre(0, 1, 2, 3));
    }
    // Scatter from rank 0.
    std::vector<float> sin = {10, 11, 12, 13}, sout(1, -1);
    ASSERT_TRUE(g.Scatter(BufferView::Of(sin.data(), kN),
                          BufferView::Of(sout.data(), 1), 0)
                    ->Wait()
                    .ok());
    EXPECT_EQ(sout[0], 10 + r);
    // AllToAll: block j of rank i is 10 i + j.
    std::vector<int32_t> ain(kN), aout(kN, -1);
    for (int j = 0; j < kN; ++j) ain[j] = 10 * r + j;
    ASSERT_TRUE(g.AllToAll(BufferView::Of(ain.data(), kN),
                           BufferView::Of(aout.data(), kN))
                    ->Wait()
                    .ok());
    EXPECT_THAT(aout, ElementsAre(r, 10 + r, 20 + r, 30 + r));
    // AllToAllV: rank i sends j + 1 copies of (10 i + j) to rank j.
    std::vector<size_t> send_counts(kN), recv_counts(kN, r + 1);
    std::vector<int32_t> vvin, vvout(kN * (r + 1), -1);
    for (int j = 0; j < kN; ++j) {
      send_counts[j] = j + 1;
      vvin.insert(vvin.end(), j + 1, 10 * r + j);
    }
    ASSERT_TRUE(
        g.AllToAllV(BufferView::Of(vvin.data(), vvin.size()), send_counts,
                    BufferView::Of(vvout.data(), vvout.size()), recv_counts)
            ->Wait()
            .ok());
    for (int i = 0; i < kN; ++i) {
      for (int k = 0; k <= r; ++k)
        EXPECT_EQ(vvout[i * (r + 1) + k], 10 * i + r);
    }
    // ReduceScatter MAX.
    std::vector<float> rin(kN), rout(1);
    for (int j = 0; j < kN; ++j) rin[j] = float(r * j);
    ASSERT_TRUE(g.ReduceScatter(BufferView::Of(rin.data(), kN),
                                BufferView::Of(rout.data(), 1), ReduceOp::kMax)
                    ->Wait()
                    .ok());
    EXPECT_EQ(rout[0], 3.0f * r);
    ASSERT_TRUE(g.Barrier()->Wait().ok());
    // Send and Recv around a ring.
    std::vector<float> mine = {float(r)}, theirs = {-1};
    auto sent = g.Send(BufferView::Of(mine.data(), 1), (r + 1) % kN, 7);
    auto got = g.Recv(BufferView::Of(theirs.data(), 1), (r + kN - 1) % kN, 7);
    ASSERT_TRUE(sent->Wait().ok());
    ASSERT_TRUE(got->Wait().ok());
    EXPECT_EQ(theirs[0], (r + kN - 1) % kN);
  });
}

TEST(NcclProcessGroup, EveryDtypeReachesNcclAsIssued) {
  Ranks ranks(2);
  ASSERT_TRUE(ranks.ok());
  ranks.RunAll([&](int r) {
    NcclProcessGroup& g = ranks.group(r);
    std::vector<char> bytes(64, 0);
    for (Dtype dtype : {Dtype::kF32, Dtype::kF64, Dtype::kF16, Dtype::kBF16,
                        Dtype::kI8, Dtype::kU8, Dtype::kI32, Dtype::kI64}) {
      BufferView view{bytes.data(), 4, dtype};
      EXPECT_TRUE(g.AllReduce(view, ReduceOp::kAvg)->Wait().ok());
    }
  });
  // NCCL sees each dtype and AVG as issued (ncclAvg on the device): no
  // f32 copies, no division on the host.
  const std::vector<std::string> calls = ranks.api(0).calls();
  for (const char* dtype :
       {"f32", "f64", "f16", "bf16", "i8", "u8", "i32", "i64"}) {
    EXPECT_THAT(calls, Contains(absl::StrCat("AllReduce(count=4, ", dtype,
                                             ", AVG, root=0)")));
  }
}

TEST(NcclProcessGroup, GatherScatterAndAllToAllAreGroupedSendsAndRecvs) {
  Ranks ranks(2);
  ASSERT_TRUE(ranks.ok());
  ranks.RunAll([&](int r) {
    std::vector<float> in(2, float(r)), out(2);
    ASSERT_TRUE(ranks.group(r)
                    .AllToAll(BufferView::Of(in.data(), 2),
                              BufferView::Of(out.data(), 2))
                    ->Wait()
                    .ok());
  });
  const std::vector<std::string> calls = ranks.api(0).calls();
  auto start = std::find(calls.begin(), calls.end(), "GroupStart");
  ASSERT_NE(start, calls.end());
  EXPECT_THAT(std::vector<std::string>(start, start + 4),
              ElementsAre("GroupStart", "Send(count=1, f32, peer=1)",
                          "Recv(count=1, f32, peer=1)", "GroupEnd"));
  EXPECT_THAT(calls, Contains("Copy(4 bytes, on device)"));
}

TEST(NcclProcessGroup, BadArgumentsFailBeforeNcclIsCalled) {
  Ranks ranks(2);
  ASSERT_TRUE(ranks.ok());
  const size_t before = ranks.api(0).calls().size();
  std::vector<float> x(4);
  auto work = ranks.group(0).Broadcast(BufferView::Of(x.data(), 4), 5);
  ASSERT_TRUE(work->IsCompleted());
  EXPECT_EQ(work->status().code(), absl::StatusCode::kInvalidArgument);
  auto gathered = ranks.group(0).AllGather(BufferView::Of(x.data(), 4),
                                           BufferView::Of(x.data(), 4));
  EXPECT_EQ(gathered->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ranks.api(0).calls().size(), before);
  auto self = ranks.group(0).Send(BufferView::Of(x.data(), 1), 0, 0);
  EXPECT_EQ(self->status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NcclProcessGroup, RanksThatIssueDifferentOpsAreToldSo) {
  Ranks ranks(2);
  ASSERT_TRUE(ranks.ok());
  ranks.RunAll([&](int r) {
    std::vector<float> x(4);
    auto work = r == 0
                    ? ranks.group(r).AllReduce(BufferView::Of(x.data(), 4),
                                               ReduceOp::kSum)
                    : ranks.group(r).Broadcast(BufferView::Of(x.data(), 4), 0);
    absl::Status status = work->Wait();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("AllReduce SUM of 4 f32"));
    // Not broken: the next op runs.
    EXPECT_TRUE(ranks.group(r).Barrier()->Wait().ok());
  });
}

TEST(NcclProcessGroup, BootstrapUsesSeveralRootsAboveRanksPerRoot) {
  NcclOptions options = TestOptions();
  options.ranks_per_root = 2;
  Ranks ranks(6, options);
  ASSERT_TRUE(ranks.ok()) << ranks.created()[0];
  for (int r = 0; r < 6; ++r) {
    EXPECT_THAT(ranks.api(r).calls(),
                Contains(absl::StrCat("InitRank(nranks=6, rank=", r,
                                      ", ids=3, device=0)")));
    EXPECT_EQ(ranks.api(r).unique_ids(), r % 2 == 0 ? 1 : 0);
  }
}

TEST(NcclProcessGroup, AMissingRootIsNamedWhenTheIdNeverComes) {
  auto store = std::make_shared<InProcessStore>();
  NcclOptions options = TestOptions();
  options.group.timeout = absl::Milliseconds(300);
  options.api = std::make_shared<FakeNcclApi>(NewFakeNcclWorld());
  // The group's timeout is the only one: ignoring it would hang the test.
  absl::Status status = NcclProcessGroup::Create(store, 1, 2, options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(status.message(), HasSubstr("rank 1 of 2"));
  EXPECT_THAT(status.message(),
              HasSubstr("not published by rank 0 (root 0 of 1, key "
                        "'comm/0/unique_id/0')"));
}

TEST(NcclProcessGroup, AnInitThatNeverCompletesIsAbortedAtTheSameDeadline) {
  auto store = std::make_shared<InProcessStore>();
  NcclOptions options = TestOptions();
  options.group.timeout = absl::Milliseconds(300);
  auto api = std::make_shared<FakeNcclApi>(NewFakeNcclWorld());
  options.api = api;
  std::vector<absl::Status> reported;
  options.error_reporter = [&](const absl::Status& s) {
    reported.push_back(s);
  };
  // Rank 0 of 3 publishes the id; ranks 1 and 2 never come. The fake's
  // init never ends by itself: only the watchdog's abort ends it.
  absl::Status status = NcclProcessGroup::Create(store, 0, 3, options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(status.message(),
              HasSubstr("NCCL init of communicator comm/0 (1 root; the unique "
                        "id exchange counts against the same deadline) did not "
                        "complete within 300ms"));
  EXPECT_THAT(status.message(),
              HasSubstr("ranks that never reached the init: 1, 2"));
  EXPECT_EQ(api->AwaitAborts(1), 1);
  EXPECT_EQ(reported.size(), 1u);
}

TEST(NcclProcessGroup, AnAsyncErrorFailsThePendingOpAndBreaksTheGroup) {
  Ranks ranks(2);
  ASSERT_TRUE(ranks.ok());
  std::vector<float> x(4);
  // Rank 1 never issues its half, so rank 0's op waits; then NCCL reports
  // a peer's failure.
  auto work =
      ranks.group(0).AllReduce(BufferView::Of(x.data(), 4), ReduceOp::kSum);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(work->IsCompleted());
  ranks.api(0).InjectAsyncError(
      absl::UnavailableError("ncclRemoteError: remote process exited"));
  absl::Status status = work->Wait(absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(status.message(),
              HasSubstr("AllReduce SUM of 4 f32 on rank 0 of 2"));
  EXPECT_THAT(status.message(), HasSubstr("remote process exited"));
  EXPECT_EQ(ranks.api(0).AwaitAborts(1), 1);
  // The group is broken, as a Gloo group would be.
  absl::Status later = ranks.group(0).Barrier()->Wait(absl::Seconds(5));
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(later.message(), HasSubstr("remote process exited"));
  auto sent = ranks.group(0).Send(BufferView::Of(x.data(), 1), 1, 0);
  EXPECT_EQ(sent->status().code(), absl::StatusCode::kFailedPrecondition);
  // Reported once, through the hook.
  auto reports = ranks.AwaitReports(1);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].first, 0);
  EXPECT_THAT(reports[0].second.message(),
              HasSubstr("nccl process group 'nccl' (communicator comm/0), rank "
                        "0 of 2"));
}

TEST(NcclProcessGroup, AHungOpIsAbortedAtItsDeadline) {
  NcclOptions options = TestOptions();
  options.group.timeout = absl::Milliseconds(300);
  Ranks ranks(2, options);
  ASSERT_TRUE(ranks.ok());
  ranks.api(1).Hang();  // Rank 1's GPU never finishes what it is given.
  std::vector<absl::Status> statuses(2);
  // Wait() has no timeout of its own: only the watchdog ends the ops.
  ranks.RunAll([&](int r) {
    std::vector<float> x(4);
    statuses[r] = ranks.group(r)
                      .AllReduce(BufferView::Of(x.data(), 4), ReduceOp::kSum)
                      ->Wait();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kDeadlineExceeded) << r;
    // verify_ops' exchange is the first thing that waits on the GPU.
    EXPECT_THAT(statuses[r].message(),
                HasSubstr(absl::StrCat("AllReduce SUM of 4 f32 on rank ", r,
                                       " of 2: verify_ops exchange did not "
                                       "complete within 300ms")));
    EXPECT_THAT(statuses[r].message(), HasSubstr("watchdog aborted"));
    EXPECT_EQ(ranks.api(r).AwaitAborts(1), 1);
  }
  EXPECT_EQ(ranks.AwaitReports(2).size(), 2u);
}

TEST(NcclProcessGroup, AHungSendIsAbortedToo) {
  NcclOptions options = TestOptions();
  options.group.timeout = absl::Milliseconds(200);
  Ranks ranks(2, options);
  ASSERT_TRUE(ranks.ok());
  std::vector<float> x(1);
  // No Recv ever matches it.
  absl::Status status =
      ranks.group(0).Send(BufferView::Of(x.data(), 1), 1, 3)->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(status.message(), HasSubstr("Send to rank 1 with tag 3"));
}

TEST(NcclProcessGroup, WorkCompletesOnlyOnceItsEventFires) {
  // Without verify_ops, whose exchange would wait for rank 1 before the op
  // is enqueued.
  NcclOptions options = TestOptions();
  options.group.verify_ops = false;
  Ranks ranks(2, options);
  ASSERT_TRUE(ranks.ok());
  std::vector<float> x0 = {1}, x1 = {2};
  auto work =
      ranks.group(0).AllReduce(BufferView::Of(x0.data(), 1), ReduceOp::kSum);
  // Enqueued on rank 0's stream but not run: the stream can wait on it,
  // the host is not blocked, the Work is not complete.
  EXPECT_TRUE(ranks.group(0).MakeStreamWait(work, nullptr).ok());
  EXPECT_FALSE(work->IsCompleted());
  auto other =
      ranks.group(1).AllReduce(BufferView::Of(x1.data(), 1), ReduceOp::kSum);
  EXPECT_TRUE(work->Wait(absl::Seconds(5)).ok());
  EXPECT_TRUE(other->Wait(absl::Seconds(5)).ok());
  EXPECT_EQ(x0[0], 3);
  // Once complete, there is nothing left to wait for.
  EXPECT_TRUE(ranks.group(0).MakeStreamWait(work, nullptr).ok());
  auto foreign = std::make_shared<Work>();
  EXPECT_EQ(ranks.group(0).MakeStreamWait(foreign, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NcclProcessGroup, SplitNumbersRanksByKeyThenRank) {
  Ranks ranks(4);
  ASSERT_TRUE(ranks.ok());
  std::vector<std::unique_ptr<NcclProcessGroup>> children(4);
  ranks.RunAll([&](int r) {
    // Color by parity; key -r reverses the order; rank 3 joins none.
    absl::StatusOr<std::unique_ptr<NcclProcessGroup>> child =
        ranks.group(r).Split(r == 3 ? -1 : r % 2, -r);
    ASSERT_TRUE(child.ok()) << child.status();
    children[r] = std::move(*child);
  });
  EXPECT_EQ(children[3], nullptr);
  EXPECT_EQ(children[0]->size(), 2);
  EXPECT_EQ(children[0]->rank(), 1);
  EXPECT_EQ(children[2]->rank(), 0);
  EXPECT_EQ(children[1]->size(), 1);
  EXPECT_EQ(children[1]->rank(), 0);
  std::vector<float> results(4, 0);
  ranks.RunAll([&](int r) {
    if (r == 3) return;
    std::vector<float> x = {float(r)};
    ASSERT_TRUE(children[r]
                    ->AllReduce(BufferView::Of(x.data(), 1), ReduceOp::kSum)
                    ->Wait()
                    .ok());
    results[r] = x[0];
  });
  EXPECT_THAT(results, ElementsAre(2, 1, 2, 0));
  // The parent goes on.
  ranks.RunAll(
      [&](int r) { EXPECT_TRUE(ranks.group(r).Barrier()->Wait().ok()); });
}

TEST(NcclProcessGroup, VerifySameSizesStagesThroughDeviceMemory) {
  Ranks ranks(3);
  ASSERT_TRUE(ranks.ok());
  std::vector<absl::Status> same(3), different(3);
  ranks.RunAll([&](int r) {
    NcclProcessGroup& g = ranks.group(r);
    ASSERT_NE(g.device_memory(), nullptr);
    std::vector<size_t> sizes = {4, 8, 16};
    same[r] = VerifySameSizes(g, sizes, "test");
    if (r == 2) sizes = {4, 16, 8};
    different[r] = VerifySameSizes(g, sizes, "test");
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(same[r].ok()) << same[r];
    EXPECT_EQ(different[r].code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(different[r].message(), HasSubstr("rank 2's parameter sizes"));
    // The staging buffer is freed; only verify_ops' scratch (128 bytes per
    // rank and the rank's own) stays.
    EXPECT_EQ(ranks.api(r).allocated_bytes(), 128u * (3 + 1));
  }
  EXPECT_THAT(ranks.api(0).calls(), Contains("Copy(24 bytes, host to device)"));
}

TEST(NcclProcessGroup, CopiesGoThroughTheGroupsStream) {
  Ranks ranks(1);
  ASSERT_TRUE(ranks.ok());
  NcclProcessGroup& g = ranks.group(0);
  void* device = *g.api().Alloc(g.device(), 16);
  float in[4] = {1, 2, 3, 4}, out[4] = {};
  ASSERT_TRUE(g.Copy(device, in, 16, CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(g.Copy(out, device, 16, CopyKind::kDeviceToHost).ok());
  EXPECT_THAT(out, ElementsAreArray(in));
  ASSERT_TRUE(g.Memset(device, 0, 16).ok());
  ASSERT_TRUE(g.Copy(out, device, 16, CopyKind::kDeviceToHost).ok());
  EXPECT_THAT(out, ElementsAre(0, 0, 0, 0));
  g.api().Free(device);
  EXPECT_THAT(ranks.api(0).calls(), Contains("Copy(16 bytes, host to device)"));
}

// DDP and FSDP zero and add buffers while collectives on others are in
// flight: that work runs on a stream of its own, not behind them.
TEST(NcclProcessGroup, DeviceMemoryDoesNotWaitForCollectivesInFlight) {
  Ranks ranks(2);
  ASSERT_TRUE(ranks.ok());
  NcclProcessGroup& g0 = ranks.group(0);
  float* reduced = static_cast<float*>(*g0.api().Alloc(g0.device(), 16));
  float* other = static_cast<float*>(*g0.api().Alloc(g0.device(), 16));
  other[0] = 5;
  // Rank 1 has not issued its all_reduce: rank 0's cannot complete yet.
  std::shared_ptr<Work> pending =
      g0.AllReduce(BufferView::Of(reduced, 4), ReduceOp::kSum);
  // The all_reduce cannot complete before rank 1 issues its half, below:
  // a Zero queued behind it would end only with its timeout, and find it
  // completed (failed) by then.
  ASSERT_TRUE(g0.device_memory()->Zero(other, 16).ok());
  EXPECT_EQ(other[0], 0.0f);
  EXPECT_FALSE(pending->IsCompleted());
  NcclProcessGroup& g1 = ranks.group(1);
  float* theirs = static_cast<float*>(*g1.api().Alloc(g1.device(), 16));
  ASSERT_TRUE(
      g1.AllReduce(BufferView::Of(theirs, 4), ReduceOp::kSum)->Wait().ok());
  EXPECT_TRUE(pending->Wait().ok());
  EXPECT_THAT(ranks.api(0).calls(), Contains("NewStream"));
  for (void* p : {static_cast<void*>(reduced), static_cast<void*>(other)}) {
    g0.api().Free(p);
  }
  g1.api().Free(theirs);
}

TEST(NcclProcessGroup, DeviceMemoryKernelsRunOnTheStream) {
  Ranks ranks(1);
  ASSERT_TRUE(ranks.ok());
  NcclProcessGroup& g = ranks.group(0);
  DeviceMemory& memory = *g.device_memory();
  float* a = static_cast<float*>(*g.api().Alloc(g.device(), 16));
  float* b = static_cast<float*>(*g.api().Alloc(g.device(), 16));
  uint16_t* half = static_cast<uint16_t*>(*g.api().Alloc(g.device(), 8));
  for (int i = 0; i < 4; ++i) {
    a[i] = i;
    b[i] = 0.5f;
  }
  ASSERT_TRUE(memory.AddF32(a, b, 4).ok());
  EXPECT_THAT(std::vector<float>(a, a + 4), ElementsAre(0.5, 1.5, 2.5, 3.5));
  ASSERT_TRUE(
      memory
          .Convert(BufferView{half, 4, Dtype::kF16}, BufferView::Of(a, 4), 2.0f)
          .ok());
  ASSERT_TRUE(
      memory
          .Convert(BufferView::Of(b, 4), BufferView{half, 4, Dtype::kF16}, 1.0f)
          .ok());
  EXPECT_THAT(std::vector<float>(b, b + 4), ElementsAre(1, 3, 5, 7));
  ElementwiseUpdate sgd;
  sgd.params = a;
  sgd.grads = b;
  sgd.count = 4;
  sgd.lr = 0.5f;
  ASSERT_TRUE(memory.Update(sgd).ok());
  EXPECT_THAT(std::vector<float>(a, a + 4), ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(ranks.api(0).calls(), Contains("AddF32(count=4)"));
  EXPECT_THAT(ranks.api(0).calls(), Contains("Convert(count=4, f32 to f16)"));
  EXPECT_THAT(ranks.api(0).calls(), Contains("Update(count=4, rule=0)"));

  // Refused before reaching the stream (the group stays usable).
  absl::Status ints = memory.Convert(BufferView{half, 4, Dtype::kF16},
                                     BufferView{a, 4, Dtype::kI32}, 1.0f);
  EXPECT_EQ(ints.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ints.message(), HasSubstr("i32 is not a floating-point type"));
  EXPECT_EQ(
      memory
          .Convert(BufferView{half, 3, Dtype::kF16}, BufferView::Of(a, 4), 1.0f)
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(memory.AddF32(nullptr, b, 4).code(),
            absl::StatusCode::kInvalidArgument);
  ElementwiseUpdate adam;
  adam.rule = ElementwiseUpdate::Rule::kAdam;
  adam.params = a;
  adam.grads = b;
  adam.count = 4;
  EXPECT_EQ(memory.Update(adam).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(g.Barrier()->Wait().ok());
  for (void* p : {static_cast<void*>(a), static_cast<void*>(b),
                  static_cast<void*>(half)}) {
    g.api().Free(p);
  }
}

}  // namespace
}  // namespace cohort

#include "worker/parallel/ddp.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/collective/process_group.h"
#include "worker/collective/testing/ranks.h"

namespace cohort {
namespace {

using ::cohort::testing::ReadFloats;
using ::cohort::testing::RunRanks;
using ::cohort::testing::TempPath;
using ::cohort::testing::WriteFloats;
using ::testing::HasSubstr;

// A world-1 group that completes every op at once (the average over one
// rank is the rank's own value), so the single-process tests can use gtest
// assertions directly; `fail_all_reduce` injects a broken connection.
class FakeGroup : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::shared_ptr<Work> Broadcast(BufferView, int) override {
    ++broadcasts;
    return Work::Done(absl::OkStatus());
  }
  std::shared_ptr<Work> AllReduce(BufferView, ReduceOp) override {
    ++all_reduces;
    return Work::Done(fail_all_reduce
                          ? absl::UnavailableError("peer 1 hung up (fake)")
                          : absl::OkStatus());
  }
  std::shared_ptr<Work> Reduce(BufferView, int, ReduceOp) override {
    return Unsupported();
  }
  std::shared_ptr<Work> AllGather(BufferView, BufferView) override {
    return Unsupported();
  }
  std::shared_ptr<Work> AllGatherV(BufferView, BufferView,
                                   absl::Span<const size_t>) override {
    return Unsupported();
  }
  std::shared_ptr<Work> Gather(BufferView, BufferView, int) override {
    return Unsupported();
  }
  std::shared_ptr<Work> Scatter(BufferView, BufferView, int) override {
    return Unsupported();
  }
  std::shared_ptr<Work> AllToAll(BufferView, BufferView) override {
    return Unsupported();
  }
  std::shared_ptr<Work> AllToAllV(BufferView, absl::Span<const size_t>,
                                  BufferView,
                                  absl::Span<const size_t>) override {
    return Unsupported();
  }
  std::shared_ptr<Work> ReduceScatter(BufferView, BufferView,
                                      ReduceOp) override {
    return Unsupported();
  }
  std::shared_ptr<Work> Barrier() override { return Unsupported(); }
  std::shared_ptr<Work> Send(BufferView, int, uint32_t) override {
    return Unsupported();
  }
  std::shared_ptr<Work> Recv(BufferView, int, uint32_t) override {
    return Unsupported();
  }

  int broadcasts = 0;
  int all_reduces = 0;
  bool fail_all_reduce = false;

 private:
  static std::shared_ptr<Work> Unsupported() {
    return Work::Done(absl::UnimplementedError("not used by the Reducer"));
  }
};

// Records when each bucket's reduction starts, as the number of MarkReady
// calls made so far (`*marks`, kept by the test), then all_reduces AVG.
class RecordingHook : public CommHook {
 public:
  explicit RecordingHook(const int* marks) : marks_(marks) {}
  std::string name() const override { return "recording"; }
  std::shared_ptr<Work> Launch(ProcessGroup& group, int bucket,
                               BufferView grads) override {
    launches.push_back({bucket, *marks_});
    return group.AllReduce(grads, ReduceOp::kAvg);
  }
  struct Launched {
    int bucket;
    int marks;
  };
  std::vector<Launched> launches;

 private:
  const int* marks_;
};

absl::Status Check(bool ok, const std::string& what) {
  return ok ? absl::OkStatus() : absl::InternalError(what);
}

#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  } while (0)

constexpr size_t kMiB = size_t{1} << 20;

TEST(ReducerTest, InitialLayoutIsReverseOrderWithFirstBucketAndCap) {
  // Bytes: p6 + p5 = 1.2 MB reach the 1 MiB first bucket's limit and close
  // it; p4 (2.4 MB) reaches the 2 MiB cap alone; p3 + p2 = 1.4 MB is short
  // of it, so p1 joins and closes the bucket at 2.2 MB (a parameter is never
  // split); p0 is left for the last bucket.
  const std::vector<size_t> sizes = {100000, 200000, 50000, 300000,
                                     600000, 150000, 150000};
  ReducerOptions options;
  options.first_bucket_bytes = 1 * kMiB;
  options.bucket_cap_bytes = 2 * kMiB;
  auto reducer =
      Reducer::Create(std::make_shared<FakeGroup>(), sizes, options).value();

  const std::vector<Reducer::Bucket>& buckets = reducer->buckets();
  ASSERT_EQ(buckets.size(), 4u);
  const std::vector<std::vector<int>> params = {{6, 5}, {4}, {3, 2, 1}, {0}};
  const std::vector<std::vector<size_t>> offsets = {
      {0, 150000}, {0}, {0, 300000, 350000}, {0}};
  const std::vector<size_t> elements = {300000, 600000, 550000, 100000};
  for (size_t b = 0; b < buckets.size(); ++b) {
    EXPECT_EQ(buckets[b].params, params[b]) << "bucket " << b;
    EXPECT_EQ(buckets[b].offsets, offsets[b]) << "bucket " << b;
    EXPECT_EQ(buckets[b].elements, elements[b]) << "bucket " << b;
  }
  // grad(i) is a view at its offset in its bucket's one contiguous buffer.
  for (size_t b = 0; b < buckets.size(); ++b) {
    const float* base = reducer->grad(buckets[b].params[0]).data();
    for (size_t k = 0; k < buckets[b].params.size(); ++k) {
      const int p = buckets[b].params[k];
      absl::Span<float> g = reducer->grad(p);
      EXPECT_EQ(g.data(), base + buckets[b].offsets[k]) << "param " << p;
      EXPECT_EQ(g.size(), sizes[p]);
      for (float v : g) ASSERT_EQ(v, 0.0f) << "param " << p;
    }
  }
  size_t total = 0;
  for (size_t s : sizes) total += s;
  EXPECT_EQ(reducer->grad_bytes(), total * sizeof(float));
  EXPECT_FALSE(reducer->rebuilt());
  EXPECT_EQ(reducer->bytes_communicated(), 0u);

  reducer->grad(3)[7] = 5.0f;
  reducer->ZeroGrad();
  EXPECT_EQ(reducer->grad(3)[7], 0.0f);
}

TEST(ReducerTest, CreateRejectsBadArguments) {
  auto group = std::make_shared<FakeGroup>();
  absl::StatusOr<std::unique_ptr<Reducer>> r = Reducer::Create(group, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  r = Reducer::Create(group, {4, 0, 2});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("parameter 1 has 0 elements"));
  ReducerOptions options;
  options.bucket_cap_bytes = 0;
  r = Reducer::Create(group, {4}, options);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  options = {};
  options.first_bucket_bytes = 0;
  r = Reducer::Create(group, {4}, options);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  r = Reducer::Create(nullptr, {4});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ReducerTest, MarkReadyAndFinishReportMisuse) {
  auto reducer =
      Reducer::Create(std::make_shared<FakeGroup>(), {1, 2, 3, 4, 5}).value();
  EXPECT_EQ(reducer->MarkReady(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reducer->MarkReady(5).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(reducer->MarkReady(2).ok());
  EXPECT_EQ(reducer->MarkReady(2).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(reducer->MarkReady(4).ok());
  ASSERT_TRUE(reducer->MarkReady(0).ok());
  absl::Status finish = reducer->Finish();
  EXPECT_EQ(finish.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(finish.message(), HasSubstr("parameters 1, 3 were not marked"));

  // The failed iteration was dropped: a complete one now succeeds.
  for (int p = 4; p >= 0; --p) ASSERT_TRUE(reducer->MarkReady(p).ok());
  EXPECT_TRUE(reducer->Finish().ok());
  EXPECT_TRUE(reducer->rebuilt());
}

TEST(ReducerTest, GradOutOfRangeIsABugThatAborts) {
  auto reducer =
      Reducer::Create(std::make_shared<FakeGroup>(), {1, 2, 3}).value();
  EXPECT_DEATH(reducer->grad(3),
               "Reducer::grad\\(3\\): parameter out of range \\[0, 3\\)");
  EXPECT_DEATH(reducer->grad(-1), "Reducer::grad\\(-1\\)");
}

TEST(ReducerTest, FailedReductionIsSticky) {
  auto group = std::make_shared<FakeGroup>();
  group->fail_all_reduce = true;
  ReducerOptions options;
  options.overlap = false;
  auto reducer = Reducer::Create(group, {3, 3}, options).value();
  ASSERT_TRUE(reducer->MarkReady(1).ok());
  ASSERT_TRUE(reducer->MarkReady(0).ok());
  absl::Status finish = reducer->Finish();
  EXPECT_EQ(finish.code(), absl::StatusCode::kUnavailable);
  absl::Status again = reducer->MarkReady(0);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.message(), HasSubstr("peer 1 hung up"));
  EXPECT_EQ(reducer->Finish().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ReducerTest, BucketsStartInBucketOrderAsSoonAsReady) {
  // 4-byte cap: every parameter has its own bucket, in order 3, 2, 1, 0.
  int marks = 0;
  auto hook = std::make_shared<RecordingHook>(&marks);
  ReducerOptions options;
  options.first_bucket_bytes = 4;
  options.bucket_cap_bytes = 4;
  options.hook = hook;
  options.rebuild_buckets = false;
  auto reducer =
      Reducer::Create(std::make_shared<FakeGroup>(), {1, 1, 1, 1}, options)
          .value();
  // Bucket 1 (param 2) is ready before bucket 0 (param 3) but must wait.
  for (int p : {2, 3, 0, 1}) {
    ++marks;
    ASSERT_TRUE(reducer->MarkReady(p).ok());
  }
  ASSERT_TRUE(reducer->Finish().ok());
  ASSERT_EQ(hook->launches.size(), 4u);
  const int expected_marks[] = {2, 2, 4, 4};
  for (int b = 0; b < 4; ++b) {
    EXPECT_EQ(hook->launches[b].bucket, b);
    EXPECT_EQ(hook->launches[b].marks, expected_marks[b]) << "bucket " << b;
  }
  // One rank sends nothing.
  EXPECT_EQ(reducer->bytes_communicated(), 0u);
}

TEST(ReducerTest, WithoutOverlapBucketsStartInFinish) {
  int marks = 0;
  auto hook = std::make_shared<RecordingHook>(&marks);
  ReducerOptions options;
  options.first_bucket_bytes = 4;
  options.bucket_cap_bytes = 4;
  options.hook = hook;
  options.overlap = false;
  auto reducer =
      Reducer::Create(std::make_shared<FakeGroup>(), {1, 1, 1}, options)
          .value();
  for (int p = 2; p >= 0; --p) {
    ++marks;
    ASSERT_TRUE(reducer->MarkReady(p).ok());
  }
  EXPECT_TRUE(hook->launches.empty());
  ++marks;  // Distinguishes launches in Finish from ones after the 3rd mark.
  ASSERT_TRUE(reducer->Finish().ok());
  ASSERT_EQ(hook->launches.size(), 3u);
  for (int b = 0; b < 3; ++b) {
    EXPECT_EQ(hook->launches[b].bucket, b);
    EXPECT_EQ(hook->launches[b].marks, 4);
  }
}

TEST(ReducerTest, NoSyncCommunicatesNothingAndAccumulates) {
  int marks = 0;
  auto hook = std::make_shared<RecordingHook>(&marks);
  auto group = std::make_shared<FakeGroup>();
  ReducerOptions options;
  options.hook = hook;
  auto reducer = Reducer::Create(group, {2, 3}, options).value();
  {
    Reducer::NoSyncScope no_sync(*reducer);
    for (int p : {1, 0}) {
      for (float& g : reducer->grad(p)) g += 1.5f;
      ASSERT_TRUE(reducer->MarkReady(p).ok());
    }
    ASSERT_TRUE(reducer->Finish().ok());
  }
  EXPECT_TRUE(hook->launches.empty());
  EXPECT_EQ(group->all_reduces, 0);
  // The rebuild's broadcast aside (nothing sent at world 1), no traffic.
  EXPECT_EQ(reducer->bytes_communicated(), 0u);
  EXPECT_TRUE(reducer->rebuilt());
  for (int p : {1, 0}) {
    for (float& g : reducer->grad(p)) g += 2.0f;
    ASSERT_TRUE(reducer->MarkReady(p).ok());
  }
  ASSERT_TRUE(reducer->Finish().ok());
  EXPECT_EQ(hook->launches.size(), 1u);
  for (int p : {0, 1}) {
    for (float g : reducer->grad(p)) EXPECT_EQ(g, 3.5f);
  }
}

// A value per (rank, parameter, element) that is exactly representable, as
// are its sums and averages over 2 or 4 ranks.
float Grad(int rank, int param, size_t k, int iteration = 0) {
  return static_cast<float>((rank + 1) * 8 + param * 2 +
                            static_cast<int>(k % 7) + iteration * 64);
}

// Runs one synchronized iteration writing Grad(...) and checks the result
// against the exact average. `order` is the MarkReady order.
absl::Status RunAveragingIteration(Reducer& reducer,
                                   const std::vector<int>& order,
                                   int iteration) {
  const int rank = reducer.group().rank();
  const int world = reducer.group().size();
  reducer.ZeroGrad();
  for (int p : order) {
    absl::Span<float> g = reducer.grad(p);
    for (size_t k = 0; k < g.size(); ++k) g[k] = Grad(rank, p, k, iteration);
    RETURN_IF_ERROR(reducer.MarkReady(p));
  }
  RETURN_IF_ERROR(reducer.Finish());
  for (int p = 0; p < reducer.num_params(); ++p) {
    absl::Span<float> g = reducer.grad(p);
    for (size_t k = 0; k < g.size(); ++k) {
      float sum = 0;
      for (int r = 0; r < world; ++r) sum += Grad(r, p, k, iteration);
      if (g[k] != sum / world) {
        return absl::InternalError(
            absl::StrCat("rank ", rank, " iteration ", iteration, ": grad(", p,
                         ")[", k, "] = ", g[k], ", want ", sum / world));
      }
    }
  }
  return absl::OkStatus();
}

void AverageAcrossRanks(int world, bool overlap) {
  RunRanks(world, [overlap](std::shared_ptr<ProcessGroup> group) {
    int marks = 0;
    auto hook = std::make_shared<RecordingHook>(&marks);
    ReducerOptions options;
    options.first_bucket_bytes = 56;  // Closed by params 5 and 4 (16 + 40).
    options.bucket_cap_bytes = 256;
    options.overlap = overlap;
    options.hook = hook;
    options.rebuild_buckets = false;
    auto reducer =
        Reducer::Create(group, {30, 17, 64, 9, 10, 4}, options).value();
    RETURN_IF_ERROR(Check(reducer->buckets().size() >= 3, "want 3+ buckets"));
    RETURN_IF_ERROR(
        Check(reducer->buckets()[0].params == std::vector<int>{5, 4},
              "first bucket should hold params 5, 4"));
    for (int iteration = 0; iteration < 2; ++iteration) {
      const size_t launched_before = hook->launches.size();
      marks = 0;
      reducer->ZeroGrad();
      const int rank = group->rank();
      for (int p = 5; p >= 0; --p) {
        absl::Span<float> g = reducer->grad(p);
        for (size_t k = 0; k < g.size(); ++k) {
          g[k] = Grad(rank, p, k, iteration);
        }
        ++marks;
        RETURN_IF_ERROR(reducer->MarkReady(p));
        if (p == 4) {
          // The first bucket is complete: with overlap it has started.
          const bool started = hook->launches.size() > launched_before;
          RETURN_IF_ERROR(Check(started == overlap,
                                absl::StrCat("bucket 0 started=", started,
                                             " after its last MarkReady with "
                                             "overlap=",
                                             overlap)));
        }
      }
      ++marks;
      RETURN_IF_ERROR(reducer->Finish());
      // With overlap every bucket starts at its last MarkReady (marks 1..6);
      // without, all start in Finish (mark 7).
      for (size_t l = launched_before; l < hook->launches.size(); ++l) {
        const int at = hook->launches[l].marks;
        RETURN_IF_ERROR(Check(overlap ? at <= 6 : at == 7,
                              absl::StrCat("launch ", l, " at mark ", at)));
      }
      for (int p = 0; p < 6; ++p) {
        absl::Span<float> g = reducer->grad(p);
        for (size_t k = 0; k < g.size(); ++k) {
          float sum = 0;
          for (int r = 0; r < group->size(); ++r)
            sum += Grad(r, p, k, iteration);
          RETURN_IF_ERROR(Check(g[k] == sum / group->size(),
                                absl::StrCat("grad(", p, ")[", k, "] = ", g[k],
                                             ", want ", sum / group->size())));
        }
      }
    }
    return absl::OkStatus();
  });
}

TEST(ReducerRanksTest, AveragesAcrossTwoRanksWithOverlap) {
  AverageAcrossRanks(2, /*overlap=*/true);
}

TEST(ReducerRanksTest, AveragesAcrossFourRanksWithOverlap) {
  AverageAcrossRanks(4, /*overlap=*/true);
}

TEST(ReducerRanksTest, AveragesAcrossTwoRanksWithoutOverlap) {
  AverageAcrossRanks(2, /*overlap=*/false);
}

// Writes a layout as floats: per bucket, its size, then (param, offset).
std::vector<float> Flatten(const std::vector<Reducer::Bucket>& buckets) {
  std::vector<float> out;
  for (const Reducer::Bucket& b : buckets) {
    out.push_back(static_cast<float>(b.params.size()));
    for (size_t k = 0; k < b.params.size(); ++k) {
      out.push_back(static_cast<float>(b.params[k]));
      out.push_back(static_cast<float>(b.offsets[k]));
    }
  }
  return out;
}

// Sees every layout and counts its own bytes: `per_launch` a Launch, from
// 7 (as if it had served before).
class LayoutHook : public CommHook {
 public:
  std::string name() const override { return "layout"; }
  std::shared_ptr<Work> Launch(ProcessGroup& group, int bucket,
                               BufferView grads) override {
    launched_with.push_back(layouts.size());
    sent += per_launch;
    return group.AllReduce(grads, ReduceOp::kAvg);
  }
  absl::Status OnLayout(absl::Span<const ReducerBucket> buckets) override {
    layouts.emplace_back(buckets.begin(), buckets.end());
    return refuse ? absl::InvalidArgumentError("layout refused")
                  : absl::OkStatus();
  }
  std::optional<uint64_t> bytes_sent() const override { return sent; }
  size_t scratch_bytes() const override { return 1000; }

  std::vector<std::vector<ReducerBucket>> layouts;
  std::vector<size_t> launched_with;  // layouts.size() at each Launch.
  uint64_t sent = 7;
  uint64_t per_launch = 100;
  bool refuse = false;
};

TEST(ReducerTest, HooksSeeEveryLayoutAndMayCountTheirBytes) {
  auto hook = std::make_shared<LayoutHook>();
  ReducerOptions options;
  options.hook = hook;
  options.first_bucket_bytes = 4;  // One bucket a parameter.
  options.bucket_cap_bytes = 4;
  auto reducer =
      Reducer::Create(std::make_shared<FakeGroup>(), {2, 3, 4}, options)
          .value();
  ASSERT_EQ(hook->layouts.size(), 1u);
  EXPECT_EQ(Flatten(hook->layouts[0]), Flatten(reducer->buckets()));
  EXPECT_EQ(reducer->grad_bytes(), 9 * sizeof(float) + 1000);
  for (int t = 0; t < 2; ++t) {
    for (int p : {0, 1, 2}) ASSERT_TRUE(reducer->MarkReady(p).ok());
    ASSERT_TRUE(reducer->Finish().ok());
  }
  // Rebuilt after the first Finish in the order 0, 1, 2, announced before
  // the second iteration's Launches.
  ASSERT_EQ(hook->layouts.size(), 2u);
  EXPECT_EQ(hook->layouts[1][0].params, std::vector<int>{0});
  EXPECT_EQ(Flatten(hook->layouts[1]), Flatten(reducer->buckets()));
  EXPECT_EQ(hook->launched_with, (std::vector<size_t>{1, 1, 1, 2, 2, 2}));
  // The hook's own count since Create: 6 Launches of 100.
  EXPECT_EQ(reducer->bytes_communicated(), 600u);

  hook->refuse = true;
  absl::StatusOr<std::unique_ptr<Reducer>> refused =
      Reducer::Create(std::make_shared<FakeGroup>(), {2}, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(), "Reducer::Create: layout refused");
}

TEST(ReducerRanksTest, RebuildsInRankZerosReadyOrder) {
  // 8 params of 4 floats (16 bytes); first bucket 32 bytes, cap 48 bytes.
  const std::vector<size_t> sizes(8, 4);
  const std::vector<int> order0 = {0, 2, 1, 3, 7, 5, 4, 6};
  const std::vector<int> order1 = {7, 6, 5, 4, 3, 2, 1, 0};
  const std::string layout_path[2] = {TempPath("layout0"), TempPath("layout1")};
  const std::string grads_path[2] = {TempPath("grads0"), TempPath("grads1")};
  RunRanks(2, [&](std::shared_ptr<ProcessGroup> group) {
    ReducerOptions options;
    options.first_bucket_bytes = 32;
    options.bucket_cap_bytes = 48;
    auto reducer = Reducer::Create(group, sizes, options).value();
    const int rank = group->rank();
    const std::vector<int>& order = rank == 0 ? order0 : order1;
    RETURN_IF_ERROR(RunAveragingIteration(*reducer, order, 0));
    RETURN_IF_ERROR(Check(reducer->rebuilt(), "not rebuilt after iteration 1"));
    // The averages survive the move into the new buckets (checked above
    // through grad(); record them for the parent as well).
    std::vector<float> grads;
    for (int p = 0; p < 8; ++p) {
      for (float v : reducer->grad(p)) grads.push_back(v);
    }
    RETURN_IF_ERROR(WriteFloats(grads_path[rank], grads));
    RETURN_IF_ERROR(
        WriteFloats(layout_path[rank], Flatten(reducer->buckets())));
    // grad() now points into the new storage, contiguous per bucket.
    for (const Reducer::Bucket& b : reducer->buckets()) {
      const float* base = reducer->grad(b.params[0]).data();
      for (size_t k = 0; k < b.params.size(); ++k) {
        RETURN_IF_ERROR(
            Check(reducer->grad(b.params[k]).data() == base + b.offsets[k],
                  "grad view not at its bucket offset"));
      }
    }
    const uint64_t bytes = reducer->bytes_communicated();
    RETURN_IF_ERROR(RunAveragingIteration(*reducer, order, 1));
    // No second rebuild: only the all_reduces of 32 floats.
    RETURN_IF_ERROR(Check(reducer->bytes_communicated() - bytes ==
                              WireBytes(Traffic::kAllReduce, 32 * 4, 2),
                          "unexpected bytes in iteration 2"));
    return absl::OkStatus();
  });
  // Rank 0's order packed: {0, 2} (32 bytes), {1, 3, 7}, {5, 4, 6}.
  const std::vector<float> want = {2, 0, 0, 2, 4,        //
                                   3, 1, 0, 3, 4, 7, 8,  //
                                   3, 5, 0, 4, 4, 6, 8};
  for (int rank = 0; rank < 2; ++rank) {
    absl::StatusOr<std::vector<float>> layout = ReadFloats(layout_path[rank]);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(*layout, want) << "rank " << rank;
    absl::StatusOr<std::vector<float>> grads = ReadFloats(grads_path[rank]);
    ASSERT_TRUE(grads.ok()) << grads.status();
    ASSERT_EQ(grads->size(), 32u);
    for (int p = 0; p < 8; ++p) {
      for (size_t k = 0; k < 4; ++k) {
        EXPECT_EQ((*grads)[p * 4 + k], (Grad(0, p, k) + Grad(1, p, k)) / 2)
            << "rank " << rank << " param " << p << " element " << k;
      }
    }
  }
}

TEST(ReducerRanksTest, NoSyncAccumulatesThenAverages) {
  RunRanks(2, [](std::shared_ptr<ProcessGroup> group) {
    int marks = 0;
    auto hook = std::make_shared<RecordingHook>(&marks);
    ReducerOptions options;
    options.hook = hook;
    options.first_bucket_bytes = 16;
    options.bucket_cap_bytes = 16;
    auto reducer = Reducer::Create(group, {3, 4, 2}, options).value();
    const int rank = group->rank();
    {
      Reducer::NoSyncScope no_sync(*reducer);
      for (int p = 2; p >= 0; --p) {
        absl::Span<float> g = reducer->grad(p);
        for (size_t k = 0; k < g.size(); ++k) g[k] += Grad(rank, p, k, 0);
        RETURN_IF_ERROR(reducer->MarkReady(p));
      }
      RETURN_IF_ERROR(reducer->Finish());
    }
    RETURN_IF_ERROR(Check(hook->launches.empty(), "no_sync launched buckets"));
    // Only the rebuild broadcast of the 3-entry ready order.
    RETURN_IF_ERROR(Check(reducer->bytes_communicated() ==
                              WireBytes(Traffic::kBroadcast, 3 * 4, 2),
                          "no_sync iteration communicated gradients"));
    for (int p = 2; p >= 0; --p) {
      absl::Span<float> g = reducer->grad(p);
      for (size_t k = 0; k < g.size(); ++k) g[k] += Grad(rank, p, k, 1);
      RETURN_IF_ERROR(reducer->MarkReady(p));
    }
    RETURN_IF_ERROR(reducer->Finish());
    RETURN_IF_ERROR(Check(!hook->launches.empty(), "synced iteration idle"));
    for (int p = 0; p < 3; ++p) {
      absl::Span<float> g = reducer->grad(p);
      for (size_t k = 0; k < g.size(); ++k) {
        const float want = (Grad(0, p, k, 0) + Grad(0, p, k, 1) +
                            Grad(1, p, k, 0) + Grad(1, p, k, 1)) /
                           2;
        RETURN_IF_ERROR(Check(
            g[k] == want,
            absl::StrCat("grad(", p, ")[", k, "] = ", g[k], ", want ", want)));
      }
    }
    return absl::OkStatus();
  });
}

// Random gradients spanning six decades, identical for a given (rank, i)
// on every rank so each rank can compute the exact average itself.
std::vector<float> RandomGrads(int rank, size_t count) {
  std::mt19937 rng(1234 + rank);
  std::uniform_real_distribution<float> exponent(-3.0f, 3.0f);
  std::uniform_real_distribution<float> mantissa(1.0f, 10.0f);
  std::vector<float> out(count);
  for (float& v : out) {
    v = mantissa(rng) * std::pow(10.0f, exponent(rng)) / 10.0f;
    if (rng() & 1) v = -v;
  }
  return out;
}

// Error bound for a compressing hook over `world` ranks, per element: each
// rank's g/world is rounded once (|err| <= u * |g_r| / world, u the unit
// roundoff), and the sum is rounded at most once per ring hop plus once at
// the end (at most `world` roundings, each <= u * sum_r |g_r| / world).
// With mean = sum_r |g_r| / world that is (world + 1) * u * mean, plus one
// subnormal spacing per rounding for f16 (2^-24).
void CheckCompressedAverage(int world, bool bf16) {
  RunRanks(world, [bf16](std::shared_ptr<ProcessGroup> group) {
    const int world = group->size();
    const std::vector<size_t> sizes = {1000, 37, 500, 3};
    size_t total = 0;
    for (size_t s : sizes) total += s;
    ReducerOptions options;
    options.hook = bf16 ? Bf16CompressHook() : Fp16CompressHook();
    options.rebuild_buckets = false;
    options.bucket_cap_bytes = 2048;
    auto reducer = Reducer::Create(group, sizes, options).value();
    RETURN_IF_ERROR(
        Check(reducer->grad_bytes() == total * 6,
              absl::StrCat("grad_bytes ", reducer->grad_bytes(),
                           ", want buckets + 16-bit scratch ", total * 6)));
    std::vector<std::vector<float>> all(world);
    for (int r = 0; r < world; ++r) all[r] = RandomGrads(r, total);
    const int rank = group->rank();
    size_t base = 0;
    std::vector<size_t> start(sizes.size());
    for (size_t p = 0; p < sizes.size(); ++p) {
      start[p] = base;
      base += sizes[p];
    }
    for (int p = static_cast<int>(sizes.size()) - 1; p >= 0; --p) {
      absl::Span<float> g = reducer->grad(p);
      for (size_t k = 0; k < g.size(); ++k) g[k] = all[rank][start[p] + k];
      RETURN_IF_ERROR(reducer->MarkReady(p));
    }
    RETURN_IF_ERROR(reducer->Finish());
    RETURN_IF_ERROR(
        Check(reducer->bytes_communicated() ==
                  WireBytes(Traffic::kAllReduce, total * 2, world),
              absl::StrCat("sent ", reducer->bytes_communicated(),
                           " bytes, want half of f32's ",
                           WireBytes(Traffic::kAllReduce, total * 4, world))));
    const double u = bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    const double tiny = bf16 ? 1e-30 : (world + 1) * std::ldexp(1.0, -24);
    double max_error = 0;
    for (size_t p = 0; p < sizes.size(); ++p) {
      absl::Span<float> g = reducer->grad(p);
      for (size_t k = 0; k < g.size(); ++k) {
        double exact = 0, mean_abs = 0;
        for (int r = 0; r < world; ++r) {
          exact += all[r][start[p] + k];
          mean_abs += std::fabs(all[r][start[p] + k]);
        }
        exact /= world;
        mean_abs /= world;
        const double error = std::fabs(g[k] - exact);
        max_error = std::max(max_error, error);
        const double bound = (world + 1) * u * mean_abs + tiny;
        RETURN_IF_ERROR(
            Check(error <= bound,
                  absl::StrCat("grad(", p, ")[", k, "] = ", g[k], ", exact ",
                               exact, ": error ", error, " > bound ", bound)));
      }
    }
    // f32 averaging would be within 1e-6 relative; anything compressed is
    // visibly coarser somewhere among 1540 values.
    RETURN_IF_ERROR(Check(max_error > 0, "no rounding error: not compressed"));
    return absl::OkStatus();
  });
}

TEST(ReducerRanksTest, Fp16CompressionStaysWithinBound) {
  CheckCompressedAverage(4, /*bf16=*/false);
}

TEST(ReducerRanksTest, Bf16CompressionStaysWithinBound) {
  CheckCompressedAverage(2, /*bf16=*/true);
}

// Ranks that wrap different models fail at Create, on every rank, naming
// the rank that differs, instead of reducing mismatched buckets.
TEST(ReducerRanksTest, CreateRejectsRanksWithDifferentModels) {
  RunRanks(3, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    std::vector<size_t> sizes = {10, 20, 30};
    if (group->rank() == 2) sizes = {10, 30, 20};  // Same sizes, reordered.
    absl::StatusOr<std::unique_ptr<Reducer>> reducer =
        Reducer::Create(group, sizes);
    RETURN_IF_ERROR(
        Check(reducer.status().code() == absl::StatusCode::kInvalidArgument,
              absl::StrCat("want INVALID_ARGUMENT, got ",
                           reducer.status().ToString())));
    RETURN_IF_ERROR(Check(
        absl::StrContains(reducer.status().message(),
                          "rank 2's parameter sizes") &&
            absl::StrContains(reducer.status().message(), "another order"),
        reducer.status().ToString()));
    // The same model everywhere still works afterwards.
    return Reducer::Create(group, {10, 20, 30}).status();
  });
}

TEST(BroadcastFromRank0Test, MixedDtypesInSeveralChunks) {
  RunRanks(3, [](std::shared_ptr<ProcessGroup> group) {
    const int rank = group->rank();
    auto value = [](int r, int i) { return r * 1000 + i; };
    std::vector<float> f(10);
    std::vector<int64_t> l(5);
    std::vector<uint8_t> u(7);
    std::vector<float> big(100);  // 400 bytes > chunk: sent in place.
    std::vector<int64_t> l2(3);
    for (size_t i = 0; i < f.size(); ++i) f[i] = value(rank, i) + 0.5f;
    for (size_t i = 0; i < l.size(); ++i) {
      l[i] = (int64_t{1} << 40) * (rank + 1) + i;
    }
    for (size_t i = 0; i < u.size(); ++i) u[i] = rank * 50 + i;
    for (size_t i = 0; i < big.size(); ++i) big[i] = value(rank, i);
    for (size_t i = 0; i < l2.size(); ++i) l2[i] = -value(rank, i);
    const std::vector<BufferView> views = {
        BufferView::Of(f.data(), f.size()), BufferView::Of(l.data(), l.size()),
        BufferView::Of(u.data(), u.size()),
        BufferView::Of(big.data(), big.size()),
        BufferView::Of(l2.data(), l2.size())};
    RETURN_IF_ERROR(BroadcastFromRank0(*group, views, /*chunk_bytes=*/48));
    bool ok = true;
    for (size_t i = 0; i < f.size(); ++i) ok &= f[i] == value(0, i) + 0.5f;
    for (size_t i = 0; i < l.size(); ++i) {
      ok &= l[i] == (int64_t{1} << 40) + static_cast<int64_t>(i);
    }
    for (size_t i = 0; i < u.size(); ++i) ok &= u[i] == i;
    for (size_t i = 0; i < big.size(); ++i) ok &= big[i] == value(0, i);
    for (size_t i = 0; i < l2.size(); ++i) ok &= l2[i] == -value(0, i);
    return Check(ok, absl::StrCat("rank ", rank, " differs from rank 0"));
  });
}

TEST(BroadcastFromRank0Test, RejectsZeroChunk) {
  FakeGroup group;
  float x = 1;
  const BufferView view = BufferView::Of(&x, 1);
  EXPECT_EQ(BroadcastFromRank0(group, {&view, 1}, 0).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cohort

#include "worker/collective/op_engine.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(10);

// A transport for an engine that plays one rank alone: in verify_ops'
// exchange every other rank issued the same op, unless `odd_rank` is set
// (it issued `odd_name`); posted transfers end when `release` is notified,
// with `transfer_status`.
class FakeTransport final : public OpEngine::Transport {
 public:
  struct Log {
    absl::Mutex mu;
    std::vector<uint32_t> exchange_tags ABSL_GUARDED_BY(mu);
    std::vector<std::string> events ABSL_GUARDED_BY(mu);

    void Add(std::string event) {
      absl::MutexLock lock(&mu);
      events.push_back(std::move(event));
    }
    std::vector<std::string> Events() {
      absl::MutexLock lock(&mu);
      return events;
    }
  };

  class Transfer final : public OpEngine::Transfer {
   public:
    explicit Transfer(FakeTransport* transport) : transport_(transport) {}
    ~Transfer() override { transport_->log.Add("unregistered"); }
    absl::Status Wait(absl::Duration timeout) override {
      if (!transport_->release.WaitForNotificationWithTimeout(timeout)) {
        return absl::DeadlineExceededError("never released");
      }
      transport_->log.Add("waited");
      return transport_->transfer_status;
    }

   private:
    FakeTransport* const transport_;
  };

  FakeTransport(int rank, int size) : rank_(rank), size_(size) {}

  absl::Status AllGatherBytes(const void* mine, size_t bytes, void* all,
                              uint32_t tag) override {
    {
      absl::MutexLock lock(&log.mu);
      log.exchange_tags.push_back(tag);
    }
    for (int r = 0; r < size_; ++r) {
      char* theirs = static_cast<char*>(all) + r * bytes;
      std::memcpy(theirs, mine, bytes);
      if (r == odd_rank && r != rank_) {
        std::memset(theirs, 0, bytes);
        odd_name.copy(theirs, bytes - 1);
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<OpEngine::Transfer>> Post(
      const PointToPointOp& op) override {
    log.Add("posted " + op.Name());
    if (!post_status.ok()) return post_status;
    return std::unique_ptr<OpEngine::Transfer>(new Transfer(this));
  }

  int odd_rank = -1;
  std::string odd_name;
  absl::Status post_status;
  absl::Status transfer_status;
  absl::Notification release;
  Log log;

 private:
  const int rank_;
  const int size_;
};

OpEngineOptions Options(int threads = 1) {
  OpEngineOptions options;
  options.group.timeout = absl::Seconds(5);
  options.group.threads = threads;
  options.name = "test group";
  return options;
}

// A body that records its calls and returns `status`.
struct Recorder {
  absl::Mutex mu;
  std::vector<uint32_t> tags ABSL_GUARDED_BY(mu);
  std::vector<CollectiveOp> ops ABSL_GUARDED_BY(mu);
  std::vector<std::string> checks ABSL_GUARDED_BY(mu);

  OpEngine::Body Body(absl::Status status = absl::OkStatus()) {
    return [this, status](const CollectiveOp& op,
                          const OpEngine::OpRun& run) {
      absl::MutexLock lock(&mu);
      tags.push_back(run.tag);
      checks.emplace_back(run.check);
      ops.push_back(op);
      return status;
    };
  }
  size_t calls() {
    absl::MutexLock lock(&mu);
    return tags.size();
  }
};

TEST(OpEngineTest, RunsOpsInIssueOrderWithTwoTagsEach) {
  FakeTransport transport(0, 2);
  Recorder recorder;
  {
    OpEngine engine(0, 2, Options(), &transport);
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < 3; ++i) {
      works.push_back(engine.Submit(CollectiveOp::Barrier(), recorder.Body()));
    }
    for (auto& work : works) EXPECT_TRUE(work->Wait(kWait).ok());
  }
  absl::MutexLock lock(&recorder.mu);
  EXPECT_THAT(recorder.tags, ElementsAre(0, 2, 4));
  absl::MutexLock log_lock(&transport.log.mu);
  EXPECT_THAT(transport.log.exchange_tags, ElementsAre(1, 3, 5));
}

TEST(OpEngineTest, ABodyThatChecksItselfGetsTheNameAndNoExchangeIsSpent) {
  FakeTransport transport(0, 2);
  Recorder recorder;
  {
    OpEngine engine(0, 2, Options(), &transport);
    float f[3] = {1, 2, 3};
    EXPECT_TRUE(engine
                    .Submit(CollectiveOp::AllReduce(BufferView::Of(f, 3),
                                                    ReduceOp::kMax),
                            recorder.Body(), /*checks_itself=*/true)
                    ->Wait(kWait)
                    .ok());
    // A body that does not check itself still gets the engine's exchange,
    // and an empty check.
    EXPECT_TRUE(engine.Submit(CollectiveOp::Barrier(), recorder.Body())
                    ->Wait(kWait)
                    .ok());
  }
  absl::MutexLock lock(&recorder.mu);
  EXPECT_THAT(recorder.checks, ElementsAre("AllReduce MAX of 3 f32", ""));
  absl::MutexLock log_lock(&transport.log.mu);
  EXPECT_THAT(transport.log.exchange_tags, ElementsAre(3));
}

TEST(OpEngineTest, WithoutVerifyOpsABodyThatChecksItselfGetsNoName) {
  FakeTransport transport(0, 2);
  Recorder recorder;
  {
    OpEngineOptions options = Options();
    options.group.verify_ops = false;
    OpEngine engine(0, 2, options, &transport);
    EXPECT_TRUE(engine.Submit(CollectiveOp::Barrier(), recorder.Body(), true)
                    ->Wait(kWait)
                    .ok());
  }
  absl::MutexLock lock(&recorder.mu);
  EXPECT_THAT(recorder.checks, ElementsAre(""));
}

TEST(OpEngineTest, BadArgumentsNeverReachTheBody) {
  FakeTransport transport(0, 2);
  Recorder recorder;
  OpEngine engine(0, 2, Options(), &transport);
  float f[4] = {};
  std::shared_ptr<Work> work = engine.Submit(
      CollectiveOp::Broadcast(BufferView::Of(f, 4), 5), recorder.Body());
  ASSERT_TRUE(work->IsCompleted());
  EXPECT_EQ(work->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(work->status().message(), HasSubstr("root 5"));
  EXPECT_TRUE(engine.Submit(CollectiveOp::Barrier(), recorder.Body())
                  ->Wait(kWait)
                  .ok());
  EXPECT_EQ(recorder.calls(), 1u);
}

TEST(OpEngineTest, AFailureNamesTheOpAndBreaksTheGroup) {
  FakeTransport transport(0, 2);
  Recorder recorder;
  OpEngine engine(0, 2, Options(), &transport);
  float f[2] = {1, 2};
  absl::Status failed =
      engine
          .Submit(CollectiveOp::AllReduce(BufferView::Of(f, 2), ReduceOp::kSum),
                  recorder.Body(absl::UnavailableError("peer 1 is gone")))
          ->Wait(kWait);
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(failed.message(),
            "AllReduce SUM of 2 f32 on rank 0 of 2: peer 1 is gone");

  absl::Status after =
      engine.Submit(CollectiveOp::Barrier(), recorder.Body())->Wait(kWait);
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(after.message(),
              HasSubstr("test group is unusable after an earlier failure"));
  EXPECT_THAT(after.message(), HasSubstr("peer 1 is gone"));
  std::shared_ptr<Work> send =
      engine.Post(PointToPointOp{true, BufferView::Of(f, 2), 1, 0});
  ASSERT_TRUE(send->IsCompleted()) << "refused at once";
  EXPECT_EQ(send->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(recorder.calls(), 1u);
}

// The flight recorder sees every op: done, failed with the engine's
// message, and refused after the group broke; collectives and Send/Recv
// numbered apart.
TEST(OpEngineTest, TheFlightRecorderSeesEveryOpAndItsEnd) {
  FakeTransport transport(0, 2);
  Recorder recorder;
  OpEngine engine(0, 2, Options(), &transport);
  float f[2] = {1, 2};
  ASSERT_TRUE(engine.Submit(CollectiveOp::Broadcast(BufferView::Of(f, 2), 1),
                            recorder.Body())
                  ->Wait(kWait)
                  .ok());
  EXPECT_FALSE(
      engine
          .Submit(CollectiveOp::AllReduce(BufferView::Of(f, 2), ReduceOp::kAvg),
                  recorder.Body(absl::UnavailableError("peer 1 is gone")))
          ->Wait(kWait)
          .ok());
  EXPECT_FALSE(engine.Submit(CollectiveOp::Barrier(), recorder.Body())
                   ->Wait(kWait)
                   .ok());
  engine.Post(PointToPointOp{true, BufferView::Of(f, 2), 1, 0});
  const std::vector<FlightRecord> records =
      engine.flight_recorder()->Snapshot();
  ASSERT_EQ(records.size(), 3u);  // The refused Send is never recorded.
  EXPECT_EQ(records[0].op, "Broadcast");
  EXPECT_EQ(records[0].root, 1);
  EXPECT_EQ(records[0].state, FlightState::kDone);
  EXPECT_EQ(records[1].op, "AllReduce");
  EXPECT_EQ(records[1].seq, 1u);
  EXPECT_EQ(records[1].reduce, ReduceOp::kAvg);
  EXPECT_EQ(records[1].state, FlightState::kFailed);
  EXPECT_THAT(records[1].error,
              HasSubstr("AllReduce AVG of 2 f32 on rank 0 of 2: peer 1 is gone"));
  EXPECT_EQ(records[2].op, "Barrier");
  EXPECT_EQ(records[2].state, FlightState::kFailed);
  EXPECT_THAT(records[2].error, HasSubstr("unusable after an earlier failure"));
  for (const FlightRecord& r : records) {
    EXPECT_LE(r.enqueued_us, r.started_us);
    EXPECT_LE(r.started_us, r.ended_us);
  }
}

// on_op_failure hears of each failed op after the recorder has it; with
// flight_records = 0 there is no recorder, and ops run as before.
TEST(OpEngineTest, FailuresAreReportedAndTheRecorderCanBeOff) {
  FakeTransport transport(0, 2);
  Recorder recorder;
  OpEngineOptions options = Options();
  options.group.flight_records = 0;
  std::vector<std::string> failures;
  absl::Mutex mu;
  options.group.on_op_failure = [&](const absl::Status& s) {
    absl::MutexLock lock(&mu);
    failures.push_back(std::string(s.message()));
  };
  OpEngine engine(0, 2, options, &transport);
  EXPECT_EQ(engine.flight_recorder(), nullptr);
  float f[2] = {1, 2};
  ASSERT_TRUE(engine.Submit(CollectiveOp::Broadcast(BufferView::Of(f, 2), 1),
                            recorder.Body())
                  ->Wait(kWait)
                  .ok());
  EXPECT_FALSE(
      engine
          .Submit(CollectiveOp::AllReduce(BufferView::Of(f, 2), ReduceOp::kAvg),
                  recorder.Body(absl::UnavailableError("peer 1 is gone")))
          ->Wait(kWait)
          .ok());
  absl::MutexLock lock(&mu);
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_THAT(failures[0], HasSubstr("peer 1 is gone"));
}

TEST(OpEngineTest, RanksThatDisagreeGetInvalidArgument) {
  FakeTransport transport(0, 3);
  transport.odd_rank = 2;
  transport.odd_name = "AllReduce SUM of 3 f32";
  Recorder recorder;
  OpEngine engine(0, 3, Options(), &transport);
  float f[4] = {};
  absl::Status status =
      engine
          .Submit(CollectiveOp::AllReduce(BufferView::Of(f, 4), ReduceOp::kSum),
                  recorder.Body())
          ->Wait(kWait);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "AllReduce SUM of 4 f32 on rank 0 of 3: the ranks issued "
            "different ops: rank 2 issued 'AllReduce SUM of 3 f32'");
  EXPECT_EQ(recorder.calls(), 0u);
  // Found before any data moved: the group stays usable.
  transport.odd_rank = -1;
  EXPECT_TRUE(engine.Submit(CollectiveOp::Barrier(), recorder.Body())
                  ->Wait(kWait)
                  .ok());
}

TEST(OpEngineTest, WithoutVerifyOpsThereIsNoExchange) {
  FakeTransport transport(0, 2);
  Recorder recorder;
  OpEngineOptions options = Options();
  options.group.verify_ops = false;
  {
    OpEngine engine(0, 2, options, &transport);
    EXPECT_TRUE(engine.Submit(CollectiveOp::Barrier(), recorder.Body())
                    ->Wait(kWait)
                    .ok());
  }
  absl::MutexLock lock(&transport.log.mu);
  EXPECT_TRUE(transport.log.exchange_tags.empty());
}

// The body of a reduction with one peer holding `peer`: it writes
// input + peer into the output (kAvg as kSum), on f32 buffers.
OpEngine::Body AddPeer(std::vector<float> peer, Dtype* seen) {
  return [peer, seen](const CollectiveOp& op, const OpEngine::OpRun&) {
    *seen = op.output.dtype;
    if (op.input.dtype != Dtype::kF32 || op.output.dtype != Dtype::kF32) {
      return absl::InternalError("the body got a half buffer");
    }
    const float* in = static_cast<const float*>(op.input.data);
    float* out = static_cast<float*>(op.output.data);
    for (size_t i = 0; i < op.output.count; ++i) out[i] = in[i] + peer[i];
    return absl::OkStatus();
  };
}

TEST(OpEngineTest, HalfReductionsRunInF32AndAvgDividesOnce) {
  FakeTransport transport(0, 2);
  OpEngine engine(0, 2, Options(), &transport);
  Float16 half[2] = {FloatToHalf(1), FloatToHalf(2)};
  Dtype seen = Dtype::kF16;
  EXPECT_TRUE(engine
                  .Submit(CollectiveOp::AllReduce(BufferView::Of(half, 2),
                                                  ReduceOp::kAvg),
                          AddPeer({2, 5}, &seen))
                  ->Wait(kWait)
                  .ok());
  EXPECT_EQ(seen, Dtype::kF32);
  EXPECT_EQ(HalfToFloat(half[0]), 1.5f);
  EXPECT_EQ(HalfToFloat(half[1]), 3.5f);

  // ReduceScatter: block 0 of four bf16 elements, summed with the peer's.
  BFloat16 input[4], output[2];
  for (int i = 0; i < 4; ++i) input[i] = FloatToBFloat16(i + 1);
  EXPECT_TRUE(engine
                  .Submit(CollectiveOp::ReduceScatter(BufferView::Of(input, 4),
                                                      BufferView::Of(output, 2),
                                                      ReduceOp::kSum),
                          AddPeer({10, 20}, &seen))
                  ->Wait(kWait)
                  .ok());
  EXPECT_EQ(BFloat16ToFloat(output[0]), 11.0f);
  EXPECT_EQ(BFloat16ToFloat(output[1]), 22.0f);
}

TEST(OpEngineTest, FullWidthAvgIsDividedInTheCallersBuffer) {
  FakeTransport transport(0, 2);
  OpEngine engine(0, 2, Options(), &transport);
  int32_t values[2] = {3, -3};
  const void* body_saw = nullptr;
  EXPECT_TRUE(engine
                  .Submit(CollectiveOp::AllReduce(BufferView::Of(values, 2),
                                                  ReduceOp::kAvg),
                          [&](const CollectiveOp& op, const OpEngine::OpRun&) {
                            body_saw = op.output.data;
                            int32_t* v = static_cast<int32_t*>(op.output.data);
                            v[0] += 4;  // The peer's 4 and 0.
                            return absl::OkStatus();
                          })
                  ->Wait(kWait)
                  .ok());
  EXPECT_EQ(body_saw, values) << "no copy for full-width dtypes";
  EXPECT_EQ(values[0], 3) << "7 / 2 truncates";
  EXPECT_EQ(values[1], -1) << "-3 / 2 truncates toward zero";
}

TEST(OpEngineTest, ReduceRunsOnACopyAndOnlyTheRootGetsTheResult) {
  float mine[2] = {1, 2};
  auto scribble = [](const CollectiveOp& op, const OpEngine::OpRun&) {
    float* v = static_cast<float*>(op.output.data);
    v[0] = 100;
    v[1] = 200;
    return absl::OkStatus();
  };
  {
    FakeTransport transport(1, 2);
    OpEngine engine(1, 2, Options(), &transport);
    EXPECT_TRUE(engine
                    .Submit(CollectiveOp::Reduce(BufferView::Of(mine, 2),
                                                 /*root=*/0, ReduceOp::kAvg),
                            scribble)
                    ->Wait(kWait)
                    .ok());
    EXPECT_EQ(mine[0], 1) << "not the root: untouched";
    EXPECT_EQ(mine[1], 2);
  }
  FakeTransport transport(0, 2);
  OpEngine engine(0, 2, Options(), &transport);
  EXPECT_TRUE(engine
                  .Submit(CollectiveOp::Reduce(BufferView::Of(mine, 2),
                                               /*root=*/0, ReduceOp::kAvg),
                          scribble)
                  ->Wait(kWait)
                  .ok());
  EXPECT_EQ(mine[0], 50);
  EXPECT_EQ(mine[1], 100);
}

TEST(OpEngineTest, AGroupOfOneCopiesOrKeepsWithoutABody) {
  FakeTransport transport(0, 1);
  Recorder recorder;
  OpEngine engine(0, 1, Options(), &transport);
  int32_t values[3] = {4, -5, 7};
  EXPECT_TRUE(engine
                  .Submit(CollectiveOp::AllReduce(BufferView::Of(values, 3),
                                                  ReduceOp::kAvg),
                          recorder.Body(absl::InternalError("ran")))
                  ->Wait(kWait)
                  .ok());
  EXPECT_EQ(values[1], -5);
  int32_t gathered[3] = {};
  EXPECT_TRUE(engine
                  .Submit(CollectiveOp::AllGather(BufferView::Of(values, 3),
                                                  BufferView::Of(gathered, 3)),
                          recorder.Body(absl::InternalError("ran")))
                  ->Wait(kWait)
                  .ok());
  EXPECT_EQ(gathered[2], 7);
  EXPECT_EQ(recorder.calls(), 0u);
}

TEST(OpEngineTest, OpsOfNoElementsNeedNoBody) {
  FakeTransport transport(0, 2);
  Recorder recorder;
  OpEngine engine(0, 2, Options(), &transport);
  EXPECT_TRUE(
      engine
          .Submit(CollectiveOp::AllReduce(BufferView{nullptr, 0, Dtype::kF32},
                                          ReduceOp::kSum),
                  recorder.Body(absl::InternalError("ran")))
          ->Wait(kWait)
          .ok());
  EXPECT_EQ(recorder.calls(), 0u);
}

TEST(OpEngineTest, DeviceMemoryBodiesGetTheOpAsIssued) {
  FakeTransport transport(0, 1);
  Recorder recorder;
  OpEngineOptions options = Options();
  options.host_memory = false;
  OpEngine engine(0, 1, options, &transport);
  Float16 half[2] = {FloatToHalf(1), FloatToHalf(3)};
  EXPECT_TRUE(engine
                  .Submit(CollectiveOp::AllReduce(BufferView::Of(half, 2),
                                                  ReduceOp::kAvg),
                          recorder.Body())
                  ->Wait(kWait)
                  .ok());
  absl::MutexLock lock(&recorder.mu);
  ASSERT_EQ(recorder.ops.size(), 1u) << "even in a group of one";
  EXPECT_EQ(recorder.ops[0].input.dtype, Dtype::kF16);
  EXPECT_EQ(recorder.ops[0].input.data, half);
  EXPECT_EQ(recorder.ops[0].reduce, ReduceOp::kAvg);
  EXPECT_EQ(HalfToFloat(half[1]), 3.0f) << "no division";
}

TEST(OpEngineTest, ATransferIsUnregisteredBeforeItCompletes) {
  FakeTransport transport(0, 2);
  OpEngine engine(0, 2, Options(), &transport);
  float f[2] = {};
  std::shared_ptr<Work> send =
      engine.Post(PointToPointOp{true, BufferView::Of(f, 2), 1, 7});
  EXPECT_FALSE(send->IsCompleted());
  transport.release.Notify();
  EXPECT_TRUE(send->Wait(kWait).ok());
  EXPECT_THAT(transport.log.Events(),
              ElementsAre("posted Send to rank 1 with tag 7", "waited",
                          "unregistered"));
}

TEST(OpEngineTest, AFailedTransferBreaksTheGroup) {
  FakeTransport transport(0, 2);
  transport.transfer_status = absl::UnavailableError("reset by peer");
  transport.release.Notify();
  Recorder recorder;
  OpEngine engine(0, 2, Options(), &transport);
  float f[2] = {};
  absl::Status recv =
      engine.Post(PointToPointOp{false, BufferView::Of(f, 2), 1, 3})
          ->Wait(kWait);
  EXPECT_EQ(recv.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(recv.message(),
            "Recv from rank 1 with tag 3 on rank 0 of 2: reset by peer");
  EXPECT_EQ(engine.Submit(CollectiveOp::Barrier(), recorder.Body())
                ->Wait(kWait)
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(OpEngineTest, APostThatFailsCompletesItsWork) {
  FakeTransport transport(0, 2);
  transport.post_status = absl::UnavailableError("no route");
  OpEngine engine(0, 2, Options(), &transport);
  float f[2] = {};
  std::shared_ptr<Work> send =
      engine.Post(PointToPointOp{true, BufferView::Of(f, 2), 1, 0});
  ASSERT_TRUE(send->IsCompleted());
  EXPECT_EQ(send->status().message(),
            "Send to rank 1 with tag 0 on rank 0 of 2: no route");
  std::shared_ptr<Work> self =
      engine.Post(PointToPointOp{true, BufferView::Of(f, 2), 0, 0});
  EXPECT_EQ(self->status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(OpEngineTest, DestructionWaitsForTheOpsIssued) {
  FakeTransport transport(0, 2);
  std::atomic<int> ran{0};
  std::vector<std::shared_ptr<Work>> works;
  {
    OpEngine engine(0, 2, Options(/*threads=*/2), &transport);
    for (int i = 0; i < 6; ++i) {
      works.push_back(engine.Submit(CollectiveOp::Barrier(),
                                    [&ran](const CollectiveOp&, const OpEngine::OpRun&) {
                                      absl::SleepFor(absl::Milliseconds(5));
                                      ++ran;
                                      return absl::OkStatus();
                                    }));
    }
  }
  EXPECT_EQ(ran.load(), 6);
  for (auto& work : works) EXPECT_TRUE(work->IsCompleted());
}

}  // namespace
}  // namespace cohort

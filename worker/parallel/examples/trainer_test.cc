// The trainer's modes against each other: every data-parallel mode at world
// sizes 1, 2 and 4 must end where one process training on the whole global
// batch ends, up to float rounding. Ranks are real forked processes.
#include "worker/parallel/examples/trainer.h"

#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "worker/collective/testing/ranks.h"

namespace cohort::examples {
namespace {

using ::cohort::testing::ReadFloats;
using ::cohort::testing::RunRanks;
using ::cohort::testing::TempPath;
using ::cohort::testing::WriteFloats;

// Small enough to run a dozen jobs in seconds; the units' flat sizes (330,
// 651, 154) are not multiples of 2 or 4, so FSDP pads.
TrainConfig SmallConfig(TrainMode mode, const std::string& optimizer) {
  TrainConfig config;
  config.mode = mode;
  config.dims = {10, 30, 21, 7};
  config.teacher_dims = {10, 16, 7};
  config.samples = 96;
  config.global_batch = 24;
  config.steps = 6;  // Crosses an epoch boundary (96 / 24 = 4 batches).
  config.seed = 3;
  config.optimizer = optimizer;
  config.lr = optimizer == "adam" ? 0.01f : 0.05f;
  config.log_every = 2;
  // Several buckets, so bucketing and overlap take part.
  config.first_bucket_bytes = 1024;
  config.bucket_cap_bytes = 2048;
  return config;
}

std::vector<float> TrainAlone(const TrainConfig& config) {
  absl::StatusOr<TrainReport> report = Train(config, nullptr);
  EXPECT_TRUE(report.ok()) << report.status();
  return report.ok() ? report->params : std::vector<float>{};
}

// Trains `config` on `world` forked ranks; returns rank 0's parameters.
std::vector<float> TrainOnRanks(const TrainConfig& config, int world) {
  const std::string out = TempPath("params");
  RunRanks(world, [&](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    absl::StatusOr<TrainReport> report = Train(config, group);
    if (!report.ok()) return report.status();
    if (group->rank() == 0) return WriteFloats(out, report->params);
    return absl::OkStatus();
  });
  absl::StatusOr<std::vector<float>> params = ReadFloats(out);
  EXPECT_TRUE(params.ok()) << params.status();
  return params.ok() ? *params : std::vector<float>{};
}

void ExpectClose(const std::vector<float>& got,
                 const std::vector<float>& expected, const std::string& what,
                 double tolerance = 2e-6) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  double worst = 0;
  size_t worst_at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double{got[i]} - expected[i]) /
                       (1e-3 + std::abs(double{expected[i]}));
    if (err > worst) {
      worst = err;
      worst_at = i;
    }
  }
  EXPECT_LE(worst, tolerance)
      << what << ": parameter " << worst_at << " is " << got[worst_at]
      << ", one process got " << expected[worst_at];
}

struct Case {
  TrainMode mode;
  std::string optimizer;
};

class TrainerEquivalenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(TrainerEquivalenceTest, MatchesOneProcessAtWorldOneTwoFour) {
  const Case c = GetParam();
  const std::vector<float> reference =
      TrainAlone(SmallConfig(TrainMode::kLocal, c.optimizer));
  ASSERT_FALSE(reference.empty());
  // The parameters must have moved, or equality would prove nothing.
  const std::vector<float> initial = [&] {
    TrainConfig zero_lr = SmallConfig(TrainMode::kLocal, c.optimizer);
    zero_lr.lr = 0;
    return TrainAlone(zero_lr);
  }();
  double moved = 0;
  for (size_t i = 0; i < initial.size(); ++i) {
    moved = std::max(moved, double{std::abs(initial[i] - reference[i])});
  }
  EXPECT_GT(moved, 1e-3);
  // Adam divides each update by the root of the gradient's second moment,
  // which magnifies the rounding differences of near-zero gradients, so it
  // gets a looser (still tight) bound than SGD.
  const double tolerance = c.optimizer == "adam" ? 2e-5 : 2e-6;
  for (int world : {1, 2, 4}) {
    ExpectClose(TrainOnRanks(SmallConfig(c.mode, c.optimizer), world),
                reference,
                absl::StrCat(TrainModeName(c.mode), " ", c.optimizer,
                             " at world ", world),
                tolerance);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, TrainerEquivalenceTest,
                         ::testing::Values(Case{TrainMode::kDdp, "sgd"},
                                           Case{TrainMode::kDdp, "adam"},
                                           Case{TrainMode::kFsdp, "sgd"},
                                           Case{TrainMode::kFsdp, "adam"},
                                           Case{TrainMode::kFsdpGradOp, "sgd"},
                                           Case{TrainMode::kFsdpNoShard,
                                                "sgd"}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrCat(TrainModeName(info.param.mode),
                                               "_", info.param.optimizer);
                         });

// Two micro-batches, the first under no_sync, equal one step on the whole
// batch: DDP at world 2 with grad_accum 2 against one process without.
TEST(TrainerTest, DdpNoSyncAccumulationMatchesOneBigBatch) {
  const std::vector<float> reference =
      TrainAlone(SmallConfig(TrainMode::kLocal, "sgd"));
  for (TrainMode mode : {TrainMode::kDdp, TrainMode::kFsdp}) {
    TrainConfig config = SmallConfig(mode, "sgd");
    config.grad_accum = 2;
    ExpectClose(TrainOnRanks(config, 2), reference,
                absl::StrCat(TrainModeName(mode), " with grad_accum 2"));
  }
}

// fsdp_prefetch trades memory for overlap and nothing else: the same
// parameters at every depth; the report's peak of gathered parameters is
// the largest unit at depth 0 (one unit at a time) and every unit at depth
// 2 (three units here, padded for two ranks to 330, 652 and 154 floats).
TEST(TrainerTest, FsdpPrefetchDepthChangesMemoryNotResults) {
  const std::vector<float> reference =
      TrainOnRanks(SmallConfig(TrainMode::kFsdp, "sgd"), 2);
  for (int depth : {0, 2}) {
    TrainConfig config = SmallConfig(TrainMode::kFsdp, "sgd");
    config.fsdp_prefetch = depth;
    const std::string out = TempPath("peak");
    RunRanks(2, [&](std::shared_ptr<ProcessGroup> group) -> absl::Status {
      absl::StatusOr<TrainReport> report = Train(config, group);
      if (!report.ok()) return report.status();
      if (group->rank() != 0) return absl::OkStatus();
      std::vector<float> written = report->params;
      written.push_back(static_cast<float>(report->peak_gathered_bytes));
      return WriteFloats(out, written);
    });
    absl::StatusOr<std::vector<float>> got = ReadFloats(out);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), reference.size() + 1);
    const float peak = got->back();
    got->pop_back();
    EXPECT_EQ(*got, reference) << "fsdp_prefetch " << depth;
    EXPECT_EQ(peak, (depth == 0 ? 652 : 330 + 652 + 154) * sizeof(float))
        << "fsdp_prefetch " << depth;
  }
}

// Compressed gradients change the result, but only by about their
// precision (sgd, 6 steps).
TEST(TrainerTest, CompressionHooksStayNearTheExactResult) {
  const std::vector<float> reference =
      TrainAlone(SmallConfig(TrainMode::kLocal, "sgd"));
  for (const char* hook : {"fp16", "bf16"}) {
    TrainConfig config = SmallConfig(TrainMode::kDdp, "sgd");
    config.comm_hook = hook;
    const std::vector<float> got = TrainOnRanks(config, 2);
    ExpectClose(got, reference, hook, 0.05);
    EXPECT_NE(got, reference) << hook << " compressed nothing";
  }
}

// A rank that dies mid-training ends its peers' training with an error
// that says which step failed, promptly, rather than a hang.
TEST(TrainerTest, APeerDyingEndsTrainingWithAnError) {
  for (TrainMode mode : {TrainMode::kDdp, TrainMode::kFsdp}) {
    RunRanks(2, [mode](std::shared_ptr<ProcessGroup> group) -> absl::Status {
      TrainConfig config = SmallConfig(mode, "sgd");
      config.steps = 1000;
      config.log_every = 1;
      const absl::Time start = absl::Now();
      absl::StatusOr<TrainReport> report =
          Train(config, group, [&](int step, float) {
            if (group->rank() == 1 && step == 3) _exit(0);
          });
      if (group->rank() == 1) {
        return absl::InternalError("rank 1 should have exited at step 3");
      }
      if (report.ok()) {
        return absl::InternalError("rank 0 trained on without rank 1");
      }
      const absl::StatusCode code = report.status().code();
      if ((code != absl::StatusCode::kUnavailable &&
           code != absl::StatusCode::kDeadlineExceeded) ||
          !absl::StrContains(report.status().message(), "step ")) {
        return absl::InternalError(absl::StrCat(
            "want UNAVAILABLE or DEADLINE_EXCEEDED naming the step, got ",
            report.status().ToString()));
      }
      if (absl::Now() - start > absl::Seconds(20)) {
        return absl::InternalError("the failure took over 20 s to surface");
      }
      return absl::OkStatus();
    });
  }
}

TEST(TrainerTest, LossGoesDownAndReportsAreFilled) {
  TrainConfig config = SmallConfig(TrainMode::kLocal, "sgd");
  config.steps = 40;
  config.log_every = 1;
  absl::StatusOr<TrainReport> report = Train(config, nullptr);
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->losses.size(), 40u);
  EXPECT_LT(report->losses.back(), 0.5 * report->losses.front());
  double sum = 0;
  for (float v : report->params) sum += v;
  EXPECT_DOUBLE_EQ(report->checksum, sum);
  EXPECT_GT(report->param_bytes, 0u);
  EXPECT_EQ(report->param_bytes, report->grad_bytes);
  EXPECT_EQ(report->optimizer_bytes, report->param_bytes);  // Momentum.
}

TEST(TrainerTest, RejectsInconsistentConfigs) {
  TrainConfig config = SmallConfig(TrainMode::kDdp, "sgd");
  EXPECT_EQ(Train(config, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);  // No group.
  config.mode = TrainMode::kLocal;
  config.global_batch = 25;
  config.grad_accum = 2;
  absl::Status status = Train(config, nullptr).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("global_batch 25"), absl::string_view::npos)
      << status;
  config = SmallConfig(TrainMode::kLocal, "rmsprop");
  EXPECT_EQ(Train(config, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  config = SmallConfig(TrainMode::kLocal, "sgd");
  config.teacher_dims = {10, 7, 6};
  EXPECT_EQ(Train(config, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ParseTrainMode("fsdp_full").ok());
  EXPECT_EQ(*ParseTrainMode("fsdp_grad_op"), TrainMode::kFsdpGradOp);
}

}  // namespace
}  // namespace cohort::examples

#include "worker/parallel/loss_scaler.h"

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/collective/testing/ranks.h"

namespace cohort {
namespace {

TEST(LossScalerTest, StartsAtGradScalersDefaultAndUnscalesExactly) {
  LossScaler scaler = LossScaler::Create({}).value();
  EXPECT_EQ(scaler.scale(), 65536.0f);
  // A power of two: multiplying by its reciprocal is exact.
  std::vector<float> a = {65536.0f, 3 * 65536.0f}, b = {-0.5f * 65536.0f};
  auto found = scaler.UnscaleAndCheck({absl::MakeSpan(a), absl::MakeSpan(b)}, nullptr);
  ASSERT_TRUE(found.ok());
  EXPECT_FALSE(*found);
  EXPECT_EQ(a, (std::vector<float>{1.0f, 3.0f}));
  EXPECT_EQ(b, (std::vector<float>{-0.5f}));
}

TEST(LossScalerTest, FindsInfAndNan) {
  LossScaler scaler = LossScaler::Create({}).value();
  for (float bad : {std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> g = {1.0f, bad, 2.0f};
    EXPECT_TRUE(*scaler.UnscaleAndCheck({absl::MakeSpan(g)}, nullptr)) << bad;
  }
}

TEST(LossScalerTest, BacksOffOnOverflowAndGrowsAfterTheInterval) {
  LossScaler scaler =
      LossScaler::Create({.init_scale = 1024.0f, .growth_interval = 3}).value();
  scaler.Update(false);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 1024.0f);
  scaler.Update(true);  // Backs off and restarts the count.
  EXPECT_EQ(scaler.scale(), 512.0f);
  scaler.Update(false);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 512.0f);
  scaler.Update(false);  // The third clean step in a row.
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  // Growth stops short of inf.
  LossScaler big = LossScaler::Create({.init_scale = 3e38f, .growth_interval = 1}).value();
  big.Update(false);
  EXPECT_EQ(big.scale(), 3e38f);
}

// A restored scaler continues as the one it was saved from: same scale,
// same count towards the next growth.
TEST(LossScalerTest, RestoreContinuesWhereTheSavedScalerWas) {
  const LossScalerOptions options{.init_scale = 1024.0f, .growth_interval = 3};
  LossScaler saved = LossScaler::Create(options).value();
  saved.Update(true);
  saved.Update(false);
  saved.Update(false);
  LossScaler restored = LossScaler::Create(options).value();
  ASSERT_TRUE(restored.Restore(saved.scale(), saved.clean_steps()).ok());
  EXPECT_EQ(restored.scale(), 512.0f);
  saved.Update(false);
  restored.Update(false);  // The third clean step for both.
  EXPECT_EQ(restored.scale(), saved.scale());
  EXPECT_EQ(restored.scale(), 1024.0f);
  EXPECT_TRUE(absl::StrContains(restored.Restore(-1.0f, 0).message(), "scale"));
  EXPECT_TRUE(
      absl::StrContains(restored.Restore(8.0f, 3).message(), "growth_interval"));
}

TEST(LossScalerTest, RefusesBadOptions) {
  auto bad = [](const LossScalerOptions& o, const char* name) {
    absl::Status s = LossScaler::Create(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_TRUE(absl::StrContains(s.message(), name)) << s;
  };
  bad({.init_scale = 0.0f}, "init_scale");
  bad({.init_scale = std::numeric_limits<float>::infinity()}, "init_scale");
  bad({.growth_factor = 1.0f}, "growth_factor");
  bad({.backoff_factor = 1.0f}, "backoff_factor");
  bad({.backoff_factor = 0.0f}, "backoff_factor");
  bad({.growth_interval = 0}, "growth_interval");
}

// Rank 1 alone overflows: every rank of 3 skips the step, and every
// scale backs off alike; the next, clean step is taken everywhere.
TEST(LossScalerTest, AnOverflowOnOneRankSkipsTheStepOnEvery) {
  testing::RunRanks(3, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    LossScaler scaler = LossScaler::Create({.init_scale = 8.0f}).value();
    std::vector<float> g = {8.0f, 16.0f};
    if (group->rank() == 1) g[1] = std::numeric_limits<float>::infinity();
    absl::StatusOr<bool> found = scaler.UnscaleAndCheck({absl::MakeSpan(g)}, group.get());
    if (!found.ok()) return found.status();
    if (!*found) {
      return absl::InternalError(absl::StrCat("rank ", group->rank(),
                                              " did not learn of rank 1's inf"));
    }
    scaler.Update(*found);
    if (scaler.scale() != 4.0f) return absl::InternalError("scale did not back off");
    std::vector<float> clean = {4.0f};
    found = scaler.UnscaleAndCheck({absl::MakeSpan(clean)}, group.get());
    if (!found.ok()) return found.status();
    if (*found || clean[0] != 1.0f) {
      return absl::InternalError(absl::StrCat("rank ", group->rank(),
                                              ": a clean step was flagged"));
    }
    return absl::OkStatus();
  });
}

}  // namespace
}  // namespace cohort

#include "worker/parallel/optimizer.h"

#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

// Steps one scalar parameter `p` through `grads` and returns its value
// after each step.
std::vector<float> Trajectory(Optimizer& opt, float p,
                              const std::vector<float>& grads) {
  std::vector<float> out;
  for (float g : grads) {
    EXPECT_TRUE(
        opt.Step(0, absl::MakeSpan(&p, 1), absl::MakeConstSpan(&g, 1)).ok());
    out.push_back(p);
  }
  return out;
}

std::unique_ptr<Optimizer> Sgd(const SgdOptions& options) {
  auto opt = NewSgd(options);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return std::move(*opt);
}

std::unique_ptr<Optimizer> Adam(const AdamOptions& options) {
  auto opt = NewAdam(options);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return std::move(*opt);
}

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want,
                double tolerance = 1e-6) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], tolerance) << "after step " << i + 1;
  }
}

TEST(SgdTest, PlainSteps) {
  // p -= 0.1 * 0.5 per step.
  auto opt = Sgd({.lr = 0.1f});
  ExpectNear(Trajectory(*opt, 1.0f, {0.5f, 0.5f, 0.5f}), {0.95, 0.90, 0.85});
  EXPECT_EQ(opt->state_bytes(), 0u);
  EXPECT_EQ(opt->name(), "sgd");
}

TEST(SgdTest, Momentum) {
  // buf: 0.5, 0.9*0.5+0.5 = 0.95, 0.9*0.95+0.5 = 1.355.
  auto opt = Sgd({.lr = 0.1f, .momentum = 0.9f});
  ExpectNear(Trajectory(*opt, 1.0f, {0.5f, 0.5f, 0.5f}), {0.95, 0.855, 0.7195});
  EXPECT_EQ(opt->state_bytes(), sizeof(float));
}

TEST(SgdTest, WeightDecay) {
  // g = 0.5 + 0.1 * p: 0.6, 0.594, 0.58806.
  auto opt = Sgd({.lr = 0.1f, .weight_decay = 0.1f});
  ExpectNear(Trajectory(*opt, 1.0f, {0.5f, 0.5f, 0.5f}),
             {0.94, 0.8806, 0.821794});
}

TEST(SgdTest, MomentumAndWeightDecay) {
  // g: 0.6, 0.594, 0.58266; buf: 0.6, 1.134, 1.60326.
  auto opt = Sgd({.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.1f});
  ExpectNear(Trajectory(*opt, 1.0f, {0.5f, 0.5f, 0.5f}),
             {0.94, 0.8266, 0.666274});
}

TEST(AdamTest, Steps) {
  // Step 1: m_hat = g, v_hat = g^2, so the step is lr * sign(g). Step 2
  // (g = -0.25): m = 0.02, v = 3.1225e-4, m_hat = 0.02 / 0.19,
  // v_hat = 3.1225e-4 / 0.001999; p = 0.9 - 0.1 * 0.105263 / 0.395225.
  auto opt = Adam({.lr = 0.1f});
  ExpectNear(Trajectory(*opt, 1.0f, {0.5f, -0.25f, 1.0f}),
             {0.900000002, 0.873366299, 0.80755514});
  EXPECT_EQ(opt->state_bytes(), 2 * sizeof(float));
  EXPECT_EQ(opt->name(), "adam");
}

TEST(AdamTest, WeightDecay) {
  // g = grad + 0.5 * p: -0.9, then 0.3 - 0.995, then -0.2 - 0.990074.
  auto opt = Adam({.lr = 0.01f, .weight_decay = 0.5f});
  ExpectNear(Trajectory(*opt, -2.0f, {0.1f, 0.3f, -0.2f}),
             {-1.99, -1.98014806, -1.97026869});
}

TEST(AdamTest, SlotsHaveTheirOwnStepCount) {
  // A slot first stepped late still gets step-1 bias correction: its first
  // update is lr * sign(g), whatever other slots have done.
  auto opt = Adam({.lr = 0.1f});
  float a = 1.0f, b = 1.0f;
  const float g = 0.5f;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        opt->Step(0, absl::MakeSpan(&a, 1), absl::MakeConstSpan(&g, 1)).ok());
  }
  ASSERT_TRUE(
      opt->Step(7, absl::MakeSpan(&b, 1), absl::MakeConstSpan(&g, 1)).ok());
  EXPECT_NEAR(b, 0.9, 1e-6);
  EXPECT_EQ(opt->state_bytes(), 4 * sizeof(float));
}

// Stepping a tensor as two shards (two slots) must give bit-identical
// values to stepping it whole: what FSDP relies on.
template <typename MakeOptimizer>
void ExpectShardingEquivalent(MakeOptimizer make) {
  constexpr size_t kSize = 37;
  constexpr size_t kSplit = 15;
  std::vector<float> whole(kSize);
  for (size_t i = 0; i < kSize; ++i) whole[i] = 0.1f * i - 1.3f;
  std::vector<float> sharded = whole;
  std::unique_ptr<Optimizer> one = make();
  std::unique_ptr<Optimizer> two = make();
  for (int step = 0; step < 4; ++step) {
    std::vector<float> grads(kSize);
    for (size_t i = 0; i < kSize; ++i) {
      grads[i] = 0.37f * ((i * 7 + step * 3) % 11) - 1.7f;
    }
    ASSERT_TRUE(one->Step(0, absl::MakeSpan(whole), grads).ok());
    absl::Span<float> p(sharded);
    absl::Span<const float> g(grads);
    ASSERT_TRUE(two->Step(0, p.subspan(0, kSplit), g.subspan(0, kSplit)).ok());
    ASSERT_TRUE(two->Step(1, p.subspan(kSplit), g.subspan(kSplit)).ok());
  }
  EXPECT_EQ(std::memcmp(whole.data(), sharded.data(), kSize * sizeof(float)),
            0);
  EXPECT_EQ(one->state_bytes(), two->state_bytes());
}

TEST(OptimizerTest, ShardingIsBitIdentical) {
  ExpectShardingEquivalent([] {
    return Sgd({.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f});
  });
  ExpectShardingEquivalent(
      [] { return Adam({.lr = 0.01f, .weight_decay = 0.02f}); });
}

TEST(OptimizerTest, StateBytes) {
  std::vector<float> p(10), g(10), q(3), h(3);
  auto sgd = Sgd({.lr = 0.1f, .momentum = 0.5f});
  ASSERT_TRUE(sgd->Step(0, absl::MakeSpan(p), g).ok());
  ASSERT_TRUE(sgd->Step(1, absl::MakeSpan(q), h).ok());
  EXPECT_EQ(sgd->state_bytes(), 13 * sizeof(float));
  auto adam = Adam({});
  ASSERT_TRUE(adam->Step(0, absl::MakeSpan(p), g).ok());
  ASSERT_TRUE(adam->Step(1, absl::MakeSpan(q), h).ok());
  ASSERT_TRUE(adam->Step(1, absl::MakeSpan(q), h).ok());
  EXPECT_EQ(adam->state_bytes(), 2 * 13 * sizeof(float));
}

TEST(OptimizerTest, StepErrors) {
  std::vector<float> p(4), g(4), short_g(3);
  std::vector<std::unique_ptr<Optimizer>> opts;
  opts.push_back(Sgd({.momentum = 0.9f}));
  opts.push_back(Adam({}));
  for (const std::unique_ptr<Optimizer>& opt : opts) {
    absl::Status s = opt->Step(-1, absl::MakeSpan(p), g);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(s.message(), "slot")) << s;
    s = opt->Step(0, absl::MakeSpan(p), short_g);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(s.message(), "gradients")) << s;
    ASSERT_TRUE(opt->Step(0, absl::MakeSpan(p), g).ok());
    s = opt->Step(0, absl::MakeSpan(p).subspan(1),
                  absl::MakeSpan(g).subspan(1));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(s.message(), "first stepped with 4")) << s;
  }
}

TEST(OptimizerTest, SgdSizeIsCheckedWithoutMomentum) {
  std::vector<float> p(4), g(4);
  auto opt = Sgd({});
  ASSERT_TRUE(opt->Step(0, absl::MakeSpan(p), g).ok());
  EXPECT_EQ(
      opt->Step(0, absl::MakeSpan(p).subspan(1), absl::MakeSpan(g).subspan(1))
          .code(),
      absl::StatusCode::kInvalidArgument);
}

void ExpectBadOption(const absl::Status& status, absl::string_view option) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), option)) << status;
}

TEST(OptimizerTest, FactoriesValidateOptions) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  ExpectBadOption(NewSgd({.lr = -0.1f}).status(), "lr");
  ExpectBadOption(NewSgd({.lr = nan}).status(), "lr");
  ExpectBadOption(NewSgd({.momentum = -0.5f}).status(), "momentum");
  ExpectBadOption(NewSgd({.weight_decay = inf}).status(), "weight_decay");
  ExpectBadOption(NewAdam({.lr = inf}).status(), "lr");
  ExpectBadOption(NewAdam({.beta1 = 1.0f}).status(), "beta1");
  ExpectBadOption(NewAdam({.beta2 = -0.1f}).status(), "beta2");
  ExpectBadOption(NewAdam({.beta2 = nan}).status(), "beta2");
  ExpectBadOption(NewAdam({.eps = 0.0f}).status(), "eps");
  ExpectBadOption(NewAdam({.weight_decay = -1.0f}).status(), "weight_decay");
  EXPECT_TRUE(NewSgd({.lr = 0.0f}).ok());
  EXPECT_TRUE(NewAdam({.beta1 = 0.0f}).ok());
}

// An optimizer whose state is exported after some steps and imported into
// a fresh one continues bit-identically: the checkpoint's resume.
TEST(OptimizerTest, ExportedStateResumesBitIdentically) {
  for (bool adam : {false, true}) {
    auto make = [&] {
      return adam ? NewAdam({.lr = 0.01f}).value()
                  : NewSgd({.lr = 0.05f, .momentum = 0.9f}).value();
    };
    std::unique_ptr<Optimizer> whole = make();
    std::unique_ptr<Optimizer> first = make();
    std::vector<float> p_whole = {1.0f, -2.0f, 0.5f}, p_split = p_whole;
    auto grad = [](int step) {
      return std::vector<float>{0.1f * step, -0.3f, 0.7f / step};
    };
    for (int step = 1; step <= 3; ++step) {
      ASSERT_TRUE(whole->Step(4, absl::MakeSpan(p_whole), grad(step)).ok());
      ASSERT_TRUE(first->Step(4, absl::MakeSpan(p_split), grad(step)).ok());
    }
    auto exported = first->ExportSlot(4);
    ASSERT_TRUE(exported.ok()) << exported.status();
    EXPECT_EQ(exported->step, 3);
    EXPECT_EQ(exported->buffers.size(), first->state_names().size());
    EXPECT_EQ(first->slots(), std::vector<int>{4});
    std::unique_ptr<Optimizer> second = make();
    ASSERT_TRUE(second->ImportSlot(4, *exported).ok());
    for (int step = 4; step <= 6; ++step) {
      ASSERT_TRUE(whole->Step(4, absl::MakeSpan(p_whole), grad(step)).ok());
      ASSERT_TRUE(second->Step(4, absl::MakeSpan(p_split), grad(step)).ok());
    }
    EXPECT_EQ(std::memcmp(p_whole.data(), p_split.data(), 3 * sizeof(float)), 0)
        << (adam ? "adam" : "sgd");
  }
}

TEST(OptimizerTest, ImportChecksWhatItIsGiven) {
  auto adam = NewAdam({}).value();
  EXPECT_EQ(adam->state_names(), (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
  EXPECT_TRUE(NewSgd({}).value()->state_names().empty());
  EXPECT_EQ(adam->ExportSlot(0).status().code(), absl::StatusCode::kNotFound);
  OptimizerSlotState one_buffer{.step = 1, .size = 2, .buffers = {{1, 2}}};
  EXPECT_EQ(adam->ImportSlot(0, one_buffer).code(),
            absl::StatusCode::kInvalidArgument);
  OptimizerSlotState short_buffer{.step = 1, .size = 2, .buffers = {{1, 2}, {3}}};
  EXPECT_TRUE(absl::StrContains(adam->ImportSlot(0, short_buffer).message(),
                                "state buffer 1 has 1 elements, expected 2"));
  EXPECT_EQ(adam->ImportSlot(-1, {}).code(), absl::StatusCode::kInvalidArgument);
  // A slot imported with one size steps only at that size.
  OptimizerSlotState good{.step = 2, .size = 2, .buffers = {{1, 2}, {3, 4}}};
  ASSERT_TRUE(adam->ImportSlot(0, good).ok());
  std::vector<float> three(3), g(3);
  EXPECT_FALSE(adam->Step(0, absl::MakeSpan(three), g).ok());
}

}  // namespace
}  // namespace cohort

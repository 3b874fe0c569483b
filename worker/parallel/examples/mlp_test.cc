#include "worker/parallel/examples/mlp.h"

#include <cmath>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "worker/parallel/examples/data.h"

namespace cohort::examples {
namespace {

// Loss of `mlp` on (x, y) with `params`, by a full forward pass.
double LossOf(Mlp& mlp, const std::vector<std::vector<float>>& params,
              const Matrix& x, const Matrix& y) {
  mlp.Begin(x);
  for (int l = 0; l < mlp.num_layers(); ++l) {
    mlp.Forward(l, {params[2 * l].data(), params[2 * l + 1].data()});
  }
  return mlp.Loss(y);
}

TEST(MlpTest, BackwardMatchesFiniteDifferences) {
  Mlp mlp({5, 7, 6, 3});
  std::vector<std::vector<float>> params = mlp.Init(11);
  const Dataset data = MakeTeacherDataset(9, {5, 4, 3}, 3);
  std::vector<std::vector<float>> grads;
  for (const auto& p : params) grads.emplace_back(p.size(), 0.0f);

  LossOf(mlp, params, data.inputs, data.targets);
  for (int l = mlp.num_layers() - 1; l >= 0; --l) {
    mlp.Backward(l, {params[2 * l].data(), params[2 * l + 1].data()},
                 {grads[2 * l].data(), grads[2 * l + 1].data()});
  }
  const float h = 1e-2f;
  for (size_t t = 0; t < params.size(); ++t) {
    for (size_t i = 0; i < params[t].size(); i += 3) {
      const float saved = params[t][i];
      params[t][i] = saved + h;
      const double up = LossOf(mlp, params, data.inputs, data.targets);
      params[t][i] = saved - h;
      const double down = LossOf(mlp, params, data.inputs, data.targets);
      params[t][i] = saved;
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(grads[t][i], numeric, 2e-3 + 2e-2 * std::abs(numeric))
          << "tensor " << t << " element " << i;
    }
  }
}

TEST(MlpTest, BackwardAccumulatesAndScales) {
  Mlp mlp({4, 5, 2});
  const std::vector<std::vector<float>> params = mlp.Init(1);
  const Dataset data = MakeTeacherDataset(6, {4, 3, 2}, 2);
  auto gradients = [&](float scale, int passes) {
    std::vector<std::vector<float>> grads;
    for (const auto& p : params) grads.emplace_back(p.size(), 0.0f);
    for (int pass = 0; pass < passes; ++pass) {
      LossOf(mlp, params, data.inputs, data.targets);
      mlp.Loss(data.targets, scale);
      for (int l = mlp.num_layers() - 1; l >= 0; --l) {
        mlp.Backward(l, {params[2 * l].data(), params[2 * l + 1].data()},
                     {grads[2 * l].data(), grads[2 * l + 1].data()});
      }
    }
    return grads;
  };
  const auto once = gradients(1.0f, 1);
  const auto halves = gradients(0.5f, 2);
  for (size_t t = 0; t < once.size(); ++t) {
    for (size_t i = 0; i < once[t].size(); ++i) {
      EXPECT_NEAR(halves[t][i], once[t][i], 1e-6f);
    }
  }
}

TEST(MlpTest, InitAndDataAreDeterministicAndDiffer) {
  Mlp mlp({8, 4});
  EXPECT_EQ(mlp.Init(5), mlp.Init(5));
  EXPECT_NE(mlp.Init(5), mlp.Init(6));
  const float bound = 1 / std::sqrt(8.0f);
  const std::vector<std::vector<float>> params = mlp.Init(5);
  for (float v : params[0]) {
    EXPECT_LE(std::abs(v), bound);
  }
  const Dataset a = MakeTeacherDataset(20, {8, 6, 4}, 9);
  const Dataset b = MakeTeacherDataset(20, {8, 6, 4}, 9);
  EXPECT_TRUE(a.inputs.isApprox(b.inputs));
  EXPECT_TRUE(a.targets.isApprox(b.targets));
  EXPECT_GT(a.targets.squaredNorm(), 0.0f);
}

// The property the trainer's equivalence rests on: batch k of b samples on
// each of N ranks is the same set of samples as batch k of b*N at N = 1.
TEST(DistributedSamplerTest, GlobalBatchesDoNotDependOnWorldSize) {
  const size_t n = 103;
  const size_t global = 12;
  const std::vector<size_t> alone = DistributedSampler(n, 1, 0, 7).Indices(2);
  EXPECT_EQ(std::set<size_t>(alone.begin(), alone.end()).size(), n);
  for (int world : {2, 3, 4}) {
    std::vector<std::vector<size_t>> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.push_back(DistributedSampler(n, world, r, 7).Indices(2));
    }
    const size_t per_rank = global / world;
    for (size_t k = 0; k < n / global; ++k) {
      std::multiset<size_t> expected(alone.begin() + k * global,
                                     alone.begin() + (k + 1) * global);
      std::multiset<size_t> got;
      for (const auto& mine : ranks) {
        got.insert(mine.begin() + k * per_rank,
                   mine.begin() + (k + 1) * per_rank);
      }
      EXPECT_EQ(got, expected) << "world " << world << " batch " << k;
    }
  }
  EXPECT_NE(DistributedSampler(n, 1, 0, 7).Indices(0),
            DistributedSampler(n, 1, 0, 7).Indices(1))
      << "epochs must shuffle differently";
}

}  // namespace
}  // namespace cohort::examples

#include "worker/parallel/examples/mlp.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <set>
#include <vector>

#include "Eigen/SVD"
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

// A running error bound, per sample in the 2-norm, for a forward pass in
// bf16 or fp16 compute against the exact (double) forward pass of the f32
// parameters. With u the unit roundoff and s the subnormal spacing
// (mixed_precision.h), W' = round(W) and the products accumulating in f32
// (a K-term dot product is off by at most g_K = K 2^-24 / (1 - K 2^-24)
// times the sum of its terms' magnitudes): if a layer's input is off by at
// most e, its pre-activation is off by at most
//   d = |W'|_2 e + |W' - W|_2 |a| + |b' - b| + g_K (||W'||_2 (|a| + e) + |b'|)
// (|.|_2 the spectral norm, ||W'|| the elementwise absolute value). The
// ReLU is 1-Lipschitz, and rounding its output v adds u |v| + s sqrt(n).
// Per sample, |(y' - t)^2 - (y - t)^2| <= e (2 |y - t| + e), so the loss
// 0.5 sum (y - t)^2 / B is off by at most the mean of half that, plus f32's
// own rounding of the loss's N-term sum.
double LowPrecisionLossBound(const Mlp& mlp, Precision p,
                             const std::vector<std::vector<float>>& params,
                             const Matrix& x, const Matrix& y) {
  using MatrixD = Eigen::MatrixXd;
  using VectorD = Eigen::VectorXd;
  const double u = UnitRoundoff(p), s = SubnormalSpacing(p);
  const double f32 = std::ldexp(1.0, -24);
  auto spectral = [](const MatrixD& m) {
    return Eigen::BDCSVD<MatrixD>(m).singularValues()(0);
  };
  auto rounded = [&](const float* data, int rows, int cols) {
    std::vector<float> copy(data, data + static_cast<size_t>(rows) * cols);
    RoundInPlace(p, absl::MakeSpan(copy));
    return MatrixD(Eigen::Map<const Matrix>(copy.data(), rows, cols)
                       .cast<double>());
  };
  MatrixD a = x.cast<double>();
  VectorD e = (rounded(x.data(), x.rows(), x.cols()) - a).colwise().norm();
  for (int l = 0; l < mlp.num_layers(); ++l) {
    const int out = mlp.dims()[l + 1], in = mlp.dims()[l];
    const MatrixD w =
        Eigen::Map<const Matrix>(params[2 * l].data(), out, in).cast<double>();
    const MatrixD b =
        Eigen::Map<const Matrix>(params[2 * l + 1].data(), out, 1)
            .cast<double>();
    const MatrixD w_r = rounded(params[2 * l].data(), out, in);
    const MatrixD b_r = rounded(params[2 * l + 1].data(), out, 1);
    const double g = (in + 1) * f32 / (1 - (in + 1) * f32);
    const VectorD a_norm = a.colwise().norm();
    const VectorD d =
        (spectral(w_r) * e + spectral(w_r - w) * a_norm).array() +
        (b_r - b).norm() +
        g * (spectral(w_r.cwiseAbs()) * (a_norm + e).array() + b_r.norm());
    MatrixD z = w * a;
    z.colwise() += b.col(0);
    a = l + 1 < mlp.num_layers() ? MatrixD(z.cwiseMax(0.0)) : z;
    e = d.array() + u * (a.colwise().norm().transpose() + d).array() +
        s * std::sqrt(static_cast<double>(out));
  }
  const VectorD miss = (a - y.cast<double>()).colwise().norm();
  const double batch = static_cast<double>(x.cols());
  const double spread =
      0.5 * (e.array() * (2 * miss + e).array()).sum() / batch;
  // f32's subtraction, squares and N-term sum in Loss: at most
  // (N + 3) 2^-24 of the largest sum of squares it could have added.
  const double n = static_cast<double>(y.size());
  const double own = (n + 3) * f32 * 0.5 * (miss + e).squaredNorm() / batch;
  return spread + own;
}

double ExactLoss(const Mlp& mlp, const std::vector<std::vector<float>>& params,
                 const Matrix& x, const Matrix& y) {
  Eigen::MatrixXd a = x.cast<double>();
  for (int l = 0; l < mlp.num_layers(); ++l) {
    const int out = mlp.dims()[l + 1], in = mlp.dims()[l];
    Eigen::MatrixXd z =
        Eigen::Map<const Matrix>(params[2 * l].data(), out, in).cast<double>() *
        a;
    z.colwise() +=
        Eigen::Map<const Eigen::VectorXf>(params[2 * l + 1].data(), out)
            .cast<double>();
    a = l + 1 < mlp.num_layers() ? Eigen::MatrixXd(z.cwiseMax(0.0)) : z;
  }
  return 0.5 * (a - y.cast<double>()).squaredNorm() / x.cols();
}

TEST(MlpTest, LowPrecisionLossIsWithinTheRunningErrorBound) {
  Mlp mlp({64, 512, 512, 16});
  const std::vector<std::vector<float>> params = mlp.Init(7);
  const Dataset data = MakeTeacherDataset(128, {64, 128, 16}, 7);
  const double exact = ExactLoss(mlp, params, data.inputs, data.targets);
  for (Precision p : {Precision::kF32, Precision::kBF16, Precision::kF16}) {
    std::vector<std::vector<float>> rounded = params;
    for (auto& t : rounded) RoundInPlace(p, absl::MakeSpan(t));
    mlp.set_precision(p);
    const double loss = LossOf(mlp, rounded, data.inputs, data.targets);
    const double bound =
        LowPrecisionLossBound(mlp, p, params, data.inputs, data.targets);
    EXPECT_LE(std::abs(loss - exact), bound) << PrecisionName(p);
    // The bound says something: under the loss itself.
    EXPECT_LT(bound, 0.5 * exact) << PrecisionName(p);
    std::printf("%s: |loss - exact| %.3g, bound %.3g, loss %.5f\n",
                std::string(PrecisionName(p)).c_str(), std::abs(loss - exact),
                bound, exact);
    if (p != Precision::kF32) {
      // And the rounding did happen.
      mlp.set_precision(Precision::kF32);
      EXPECT_NE(loss, LossOf(mlp, params, data.inputs, data.targets))
          << PrecisionName(p);
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

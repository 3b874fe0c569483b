#include "worker/parallel/powersgd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
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
#include "worker/parallel/ddp.h"

namespace cohort {
namespace {

using ::cohort::testing::RunRanks;
using ::testing::HasSubstr;

// f32's unit roundoff: a rounded operation's relative error is at most u.
const double kU = std::ldexp(1.0, -24);

using Grads = std::vector<std::vector<float>>;  // Per parameter.

std::vector<size_t> Sizes(const std::vector<MatrixShape>& shapes) {
  std::vector<size_t> sizes;
  for (const MatrixShape& s : shapes) sizes.push_back(s.rows * s.cols);
  return sizes;
}

// A PowerSGD hook over `shapes` and a Reducer using it.
struct Setup {
  std::shared_ptr<PowerSgdHook> hook;
  std::unique_ptr<Reducer> reducer;
};

Setup MakeReducer(std::shared_ptr<ProcessGroup> group,
                  const PowerSgdOptions& options,
                  const std::vector<MatrixShape>& shapes,
                  ReducerOptions reducer_options = {}) {
  Setup setup;
  setup.hook = PowerSgdHook::Create(options, shapes).value();
  reducer_options.hook = setup.hook;
  setup.reducer =
      Reducer::Create(std::move(group), Sizes(shapes), reducer_options).value();
  return setup;
}

// x y^T with x_i = 1 + i/4, y_j = 2 - j/8: few enough bits that every
// product is exact in f32, so the matrix is exactly of rank 1.
std::vector<float> RankOne(size_t rows, size_t cols) {
  std::vector<float> m(rows * cols);
  for (size_t j = 0; j < cols; ++j) {
    for (size_t i = 0; i < rows; ++i) {
      m[i + rows * j] = (1.0f + 0.25f * i) * (2.0f - 0.125f * j);
    }
  }
  return m;
}

// One synchronized iteration: writes `grads` into the reducer, marks the
// parameters ready (last first as backward does, or first first) and
// finishes; returns the reduced gradients.
absl::StatusOr<Grads> Step(Reducer& reducer, const Grads& grads,
                           bool forward_order = false) {
  reducer.ZeroGrad();
  const int n = reducer.num_params();
  for (int k = 0; k < n; ++k) {
    const int p = forward_order ? k : n - 1 - k;
    absl::Span<float> g = reducer.grad(p);
    std::copy(grads[p].begin(), grads[p].end(), g.begin());
    if (absl::Status s = reducer.MarkReady(p); !s.ok()) return s;
  }
  if (absl::Status s = reducer.Finish(); !s.ok()) return s;
  Grads out;
  for (int p = 0; p < n; ++p) {
    absl::Span<float> g = reducer.grad(p);
    out.emplace_back(g.begin(), g.end());
  }
  return out;
}

// Rank r's gradient for `shapes` at iteration t: uniform on [-1, 1] for
// matrices; for vectors (and every element when `exact`), multiples of 1/8
// below 16 in magnitude, whose sums over a few ranks are exact in f32, so
// that an average is one rounding (the division) whatever the order.
Grads RankGrads(const std::vector<MatrixShape>& shapes, int rank, int t,
                bool exact = false) {
  std::mt19937 engine(1000 * rank + t);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_int_distribution<int> eighths(-127, 127);
  Grads grads;
  for (const MatrixShape& s : shapes) {
    std::vector<float> g(s.rows * s.cols);
    for (float& v : g) {
      v = (exact || s.cols == 1) ? eighths(engine) / 8.0f : uniform(engine);
    }
    grads.push_back(std::move(g));
  }
  return grads;
}

// Every rank's average, with the order-independent arithmetic above.
std::vector<float> ExactAverage(const std::vector<Grads>& all, int p) {
  std::vector<float> avg(all[0][p].size());
  for (size_t k = 0; k < avg.size(); ++k) {
    float sum = 0;
    for (const Grads& g : all) sum += g[p][k];
    avg[k] = sum / static_cast<float>(all.size());
  }
  return avg;
}

absl::Status ExpectEqual(const std::vector<float>& got,
                         const std::vector<float>& want,
                         const std::string& what) {
  for (size_t k = 0; k < want.size(); ++k) {
    if (got[k] != want[k]) {
      return absl::InternalError(absl::StrCat(what, "[", k, "] = ", got[k],
                                              ", want exactly ", want[k]));
    }
  }
  return absl::OkStatus();
}

double Norm(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x * x;
  return std::sqrt(sum);
}

// The average of parameter p over the ranks' gradients, in double (exact
// for a few ranks' f32 values but for the last bits), and the average of
// their absolute values.
struct Averages {
  std::vector<double> mean;
  std::vector<double> mean_abs;
};

Averages Average(const std::vector<Grads>& all, int p) {
  Averages a;
  a.mean.assign(all[0][p].size(), 0);
  a.mean_abs.assign(all[0][p].size(), 0);
  for (const Grads& g : all) {
    for (size_t k = 0; k < g[p].size(); ++k) {
      a.mean[k] += g[p][k] / static_cast<double>(all.size());
      a.mean_abs[k] += std::fabs(g[p][k]) / static_cast<double>(all.size());
    }
  }
  return a;
}

// PowerSGD's rank-1 step on the average A (rows x cols, column-major) in
// exact arithmetic, from the hook's initial Q: q = q0 / |q0|, P = A q / |A q|,
// Q = A^T P, result P Q^T (A projected onto P). Also the bound on how far
// the hook's f32 result on `world` ranks may be from it, in the Frobenius
// norm, with u = 2^-24, n = rows, m = cols, W = world, |.| the 2-norm and
// S = the average of the ranks' |M_r| (so |M_r q| <= S|q| elementwise):
//  1. q~ (q0 normalized in f32: a norm of m squares, a division) is off by
//     eta_q <= (m + 10) u.
//  2. Each rank's M_r q~ has dot products of m terms, error <= m u times the
//     sum of the terms' magnitudes; the AVG all_reduce adds W roundings of
//     at most that sum: |P~ - A q| <= |A| eta_q + (m + W + 2) u |S| (1 +
//     eta_q) =: dp.
//  3. Normalizing moves a vector x by at most 2 |x - y| / |y| from y's
//     direction, plus its own rounding (n squares): P^ is off by
//     eta_p <= 2 dp / |A q| + (n + 10) u.
//  4. Q~ = avg M_r^T P^~ (dots of n terms, then W roundings) is off from
//     A^T P^ by dQ <= |A| eta_p + (n + W + 2) u |S| (1 + eta_p).
//  5. P^~ Q~^T (products of single terms, one rounding each) is off from
//     P^ Q^T by eta_p |Q~| + dQ + u |P^~| |Q~|, with |Q~| <= |Q| + dQ.
// The double-precision reference itself is exact to about (n + m) 2^-53
// relative; 1e-12 |A| covers it.
struct Reference {
  std::vector<double> result;
  double bound = 0;
};

Reference RankOneReference(const Averages& a, size_t rows, size_t cols,
                           const std::vector<float>& q0, int world) {
  std::vector<double> q(q0.begin(), q0.end());
  const double q_norm = Norm(q);
  for (double& x : q) x /= q_norm;
  std::vector<double> p(rows, 0);
  for (size_t j = 0; j < cols; ++j) {
    for (size_t i = 0; i < rows; ++i) p[i] += a.mean[i + j * rows] * q[j];
  }
  const double p_norm = Norm(p);
  for (double& x : p) x /= p_norm;
  std::vector<double> qq(cols, 0);
  for (size_t j = 0; j < cols; ++j) {
    for (size_t i = 0; i < rows; ++i) qq[j] += a.mean[i + j * rows] * p[i];
  }
  Reference ref;
  ref.result.resize(rows * cols);
  for (size_t j = 0; j < cols; ++j) {
    for (size_t i = 0; i < rows; ++i) ref.result[i + j * rows] = p[i] * qq[j];
  }
  const double a_norm = Norm(a.mean);
  const double s_norm = Norm(a.mean_abs);
  const double n = rows, m = cols, w = world;
  const double eta_q = (m + 10) * kU;
  const double dp = a_norm * eta_q + (m + w + 2) * kU * s_norm * (1 + eta_q);
  const double eta_p = 2 * dp / p_norm + (n + 10) * kU;
  const double dq = a_norm * eta_p + (n + w + 2) * kU * s_norm * (1 + eta_p);
  const double q_max = Norm(qq) + dq;
  ref.bound = eta_p * q_max + dq + kU * (1 + eta_p) * q_max + 1e-12 * a_norm;
  return ref;
}

std::vector<float> InitialQ(uint64_t seed, int param, int64_t iteration,
                            size_t cols) {
  std::vector<float> q(cols);
  PowerSgdInitialQ(seed, param, iteration, absl::MakeSpan(q));
  return q;
}

absl::Status ExpectNear(const std::vector<float>& got, const Reference& want,
                        const std::string& what) {
  std::vector<double> diff(got.size());
  for (size_t k = 0; k < got.size(); ++k) diff[k] = got[k] - want.result[k];
  const double error = Norm(diff);
  if (!(error <= want.bound)) {
    return absl::InternalError(
        absl::StrCat(what, ": |got - reference| = ", error, " > bound ",
                     want.bound, " (|reference| = ", Norm(want.result), ")"));
  }
  return absl::OkStatus();
}

TEST(PowerSgdHookTest, CreateRejectsBadOptionsAndShapes) {
  const std::vector<MatrixShape> shapes = {{4, 3}};
  auto rejected = [&](const PowerSgdOptions& options,
                      std::vector<MatrixShape> s, const std::string& text) {
    absl::StatusOr<std::shared_ptr<PowerSgdHook>> hook =
        PowerSgdHook::Create(options, std::move(s));
    EXPECT_EQ(hook.status().code(), absl::StatusCode::kInvalidArgument)
        << hook.status();
    EXPECT_THAT(hook.status().message(), HasSubstr(text));
  };
  PowerSgdOptions options;
  options.matrix_approximation_rank = 0;
  rejected(options, shapes, "matrix_approximation_rank is 0");
  options = {};
  options.start_powersgd_iter = -1;
  rejected(options, shapes, "start_powersgd_iter is -1");
  options = {};
  options.min_compression_rate = std::nan("");
  rejected(options, shapes, "min_compression_rate");
  options = {};
  options.orthogonalization_epsilon = -1e-8f;
  rejected(options, shapes, "orthogonalization_epsilon");
  rejected({}, {}, "0 parameter shapes");
  rejected({}, {{4, 3}, {0, 5}}, "parameter 1 has shape 0 x 5");
  EXPECT_TRUE(PowerSgdHook::Create({}, shapes).ok());
}

// (rows x cols) / ((rows + cols) x min(r, rows, cols)) >= the rate, and
// more than one column.
TEST(PowerSgdHookTest, CompressesOnlyMatricesThatShrinkEnough) {
  const std::vector<MatrixShape> shapes = {{10, 1},   {4, 4},  {3, 3},
                                           {100, 50}, {1, 10}, {6, 2}};
  auto hook = PowerSgdHook::Create({}, shapes).value();
  EXPECT_EQ(hook->name(), "powersgd_r1");
  // 10 x 1: a bias. 4 x 4: 16 / 8 = 2. 3 x 3: 1.5. 100 x 50: 33. 1 x 10:
  // 10 / 11. 6 x 2: 12 / 8 = 1.5.
  const std::vector<bool> want = {false, true, false, true, false, false};
  for (int p = 0; p < 6; ++p) EXPECT_EQ(hook->compressed(p), want[p]) << p;
  EXPECT_FALSE(hook->compressed(6));

  PowerSgdOptions options;
  options.matrix_approximation_rank = 2;
  options.min_compression_rate = 1.5;
  hook = PowerSgdHook::Create(options, shapes).value();
  EXPECT_EQ(hook->name(), "powersgd_r2");
  // 4 x 4 at r = 2: 16 / 16 = 1. 3 x 3: 9 / 12. 100 x 50: 16.7. 6 x 2: r is
  // clamped to 2 columns, 12 / 16.
  const std::vector<bool> want_r2 = {false, false, false, true, false, false};
  for (int p = 0; p < 6; ++p) EXPECT_EQ(hook->compressed(p), want_r2[p]) << p;
}

TEST(PowerSgdHookTest, OnLayoutRejectsShapesThatDoNotMatchTheReducer) {
  auto hook = PowerSgdHook::Create({}, {{2, 5}, {3, 3}}).value();
  ReducerBucket bucket;
  bucket.params = {1, 0};
  bucket.offsets = {0, 12};
  bucket.elements = 22;  // Parameter 1 holds 12 elements, not 3 x 3.
  absl::Status status = hook->OnLayout({bucket});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("parameter 1 has 12 elements in the Reducer but its "
                        "shape 3 x 3 has 9"));

  bucket.params = {1};
  bucket.offsets = {0};
  bucket.elements = 9;
  status = hook->OnLayout({bucket});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("shapes for 2 parameters but the Reducer's buckets "
                        "hold 1"));

  bucket.params = {1, 1};
  bucket.offsets = {0, 9};
  bucket.elements = 18;
  status = hook->OnLayout({bucket});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("held twice"));

  bucket.params = {1, 0};
  bucket.offsets = {0, 9};
  bucket.elements = 19;
  EXPECT_TRUE(hook->OnLayout({bucket}).ok());
  EXPECT_EQ(hook->scratch_bytes(), 0u);  // Nothing compressed.
}

// Through the Reducer, the mismatch fails Create; misuse of the hook on its
// own is reported on its Work or by Finalize.
TEST(PowerSgdRanksTest, ReducerCreateAndMisuseReportErrors) {
  RunRanks(1, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    ReducerOptions options;
    options.hook = PowerSgdHook::Create({}, {{4, 3}, {5, 1}}).value();
    absl::StatusOr<std::unique_ptr<Reducer>> reducer =
        Reducer::Create(group, {12, 6}, options);
    RANK_CHECK(reducer.status().code() == absl::StatusCode::kInvalidArgument);
    RANK_CHECK(absl::StartsWith(
        reducer.status().message(),
        "Reducer::Create: PowerSGD: parameter 1 has 6 elements"));

    auto hook = PowerSgdHook::Create({}, {{4, 3}}).value();
    std::vector<float> grads(12);
    const BufferView view = BufferView::Of(grads.data(), grads.size());
    absl::Status launched = hook->Launch(*group, 0, view)->Wait();
    RANK_CHECK(launched.code() == absl::StatusCode::kFailedPrecondition);
    RANK_CHECK(absl::StrContains(launched.message(), "the layout has 0"));
    ReducerBucket bucket{{0}, {0}, 12};
    RANK_OK(hook->OnLayout({bucket}));
    absl::Status finalized = hook->Finalize(0, view);
    RANK_CHECK(finalized.code() == absl::StatusCode::kFailedPrecondition);
    RANK_CHECK(absl::StrContains(finalized.message(), "without a matching"));
    launched = hook->Launch(*group, 0, BufferView{grads.data(), 6, Dtype::kF64})
                   ->Wait();
    RANK_CHECK(launched.code() == absl::StatusCode::kInvalidArgument);
    return absl::OkStatus();
  });
}

// A rank-1 gradient M = x y^T (RankOne), the same on both ranks, at rank 1: P =
// M q spans M's column space, so one iteration gives M back, within the
// reference's bound (here A = S = M, and the reference P P^T M is M itself).
// The residual is then M minus that, one more rounding.
TEST(PowerSgdRanksTest, RankOneGradientIsReproducedInOneIteration) {
  RunRanks(2, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    const std::vector<MatrixShape> shapes = {{40, 30}, {40, 1}};
    PowerSgdOptions options;
    options.start_powersgd_iter = 0;
    options.seed = 7;
    auto [hook, reducer] = MakeReducer(group, options, shapes);
    RANK_CHECK(hook->compressed(0) && !hook->compressed(1));
    Grads grads = RankGrads(shapes, /*rank=*/0, 0);
    grads[0] = RankOne(40, 30);
    absl::StatusOr<Grads> out = Step(*reducer, grads);
    RANK_OK(out.status());
    const Averages a = Average({grads}, 0);
    Reference ref = RankOneReference(a, 40, 30, InitialQ(7, 0, 0, 30), 2);
    ref.result = a.mean;  // P P^T M = M.
    RANK_OK(ExpectNear((*out)[0], ref, "rank-1 gradient"));
    RANK_OK(ExpectEqual((*out)[1], grads[1], "bias"));
    absl::Span<const float> e = hook->error(0);
    std::vector<double> residual(e.begin(), e.end());
    RANK_CHECK(Norm(residual) <= ref.bound * (1 + kU));
    RANK_CHECK(hook->error(1).empty());
    return absl::OkStatus();
  });
}

// At rank 2 a rank-1 gradient makes P's second column M q_2 parallel to
// the first but for rounding: what Gram-Schmidt leaves of it is noise,
// which must still come out orthogonal to the first, or P P^T is no
// projection. The error then depends on how that noise falls (no bound
// from observable quantities), so this threshold separates regimes rather
// than bounding: two passes give about 1e-6 |M| (at most 7.3e-7 over 200
// random cases, 40 x 30), one pass 1e-1 to 0.8 |M| (all 200 over 1e-4).
TEST(PowerSgdRanksTest, RankAboveTheGradientsStaysAProjection) {
  RunRanks(1, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    const std::vector<MatrixShape> shapes = {{40, 30}};
    PowerSgdOptions options;
    options.matrix_approximation_rank = 2;
    options.start_powersgd_iter = 0;
    auto [hook, reducer] = MakeReducer(group, options, shapes);
    const Grads grads = {RankOne(40, 30)};
    absl::StatusOr<Grads> out = Step(*reducer, grads);
    RANK_OK(out.status());
    std::vector<double> diff(1200), m(grads[0].begin(), grads[0].end());
    for (size_t k = 0; k < 1200; ++k) diff[k] = (*out)[0][k] - grads[0][k];
    RANK_CHECK(Norm(diff) <= 1e-4 * Norm(m));
    return absl::OkStatus();
  });
}

// A warm-start Q whose columns vanished (the first compressed gradient was
// zero, so P, and then Q = M^T P, were zero) is drawn afresh, for this
// iteration; it does not stay zero.
TEST(PowerSgdRanksTest, AZeroGradientDoesNotStallTheWarmStart) {
  RunRanks(1, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    const std::vector<MatrixShape> shapes = {{20, 16}};
    PowerSgdOptions options;
    options.start_powersgd_iter = 0;
    auto [hook, reducer] = MakeReducer(group, options, shapes);
    Grads zero = {std::vector<float>(320, 0.0f)};
    absl::StatusOr<Grads> out = Step(*reducer, zero);
    RANK_OK(out.status());
    RANK_OK(ExpectEqual((*out)[0], zero[0], "zero gradient"));
    const Grads grads = {RankOne(20, 16)};
    out = Step(*reducer, grads);
    RANK_OK(out.status());
    const Averages a = Average({grads}, 0);
    Reference ref = RankOneReference(a, 20, 16, InitialQ(0, 0, 1, 16), 1);
    ref.result = a.mean;
    RANK_OK(ExpectNear((*out)[0], ref, "rank-1 gradient after a zero one"));
    return absl::OkStatus();
  });
}

// Different gradients on each rank: the result is the rank-1 PowerSGD
// approximation of their average (RankOneReference, same seed), and the
// vectors are averaged exactly. Two buckets.
void MatchesOneProcess(int world) {
  RunRanks(world, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    const int world = group->size();
    const std::vector<MatrixShape> shapes = {
        {24, 16}, {24, 1}, {8, 24}, {8, 1}};
    PowerSgdOptions options;
    options.start_powersgd_iter = 0;
    options.seed = 42;
    ReducerOptions reducer_options;
    reducer_options.first_bucket_bytes = 800;  // Params 3 and 2.
    auto [hook, reducer] = MakeReducer(group, options, shapes, reducer_options);
    RANK_CHECK(reducer->buckets().size() == 2);
    std::vector<Grads> all;
    for (int r = 0; r < world; ++r) all.push_back(RankGrads(shapes, r, 0));
    absl::StatusOr<Grads> out = Step(*reducer, all[group->rank()]);
    RANK_OK(out.status());
    for (int p : {0, 2}) {
      const Reference ref =
          RankOneReference(Average(all, p), shapes[p].rows, shapes[p].cols,
                           InitialQ(42, p, 0, shapes[p].cols), world);
      RANK_OK(ExpectNear((*out)[p], ref, absl::StrCat("matrix ", p)));
    }
    for (int p : {1, 3}) {
      RANK_OK(ExpectEqual((*out)[p], ExactAverage(all, p),
                          absl::StrCat("bias ", p)));
    }
    return absl::OkStatus();
  });
}

TEST(PowerSgdRanksTest, MatchesOneProcessOnTwoRanks) { MatchesOneProcess(2); }

TEST(PowerSgdRanksTest, MatchesOneProcessOnThreeRanks) { MatchesOneProcess(3); }

// Before start_powersgd_iter every bucket is all_reduced (AVG) whole; after
// it the biases and the 3 x 3 matrix (too small to gain) are still averaged
// exactly, and the bytes are those of the packed uncompressed elements and
// P's, then the Q's: far fewer than the f32 bucket's.
TEST(PowerSgdRanksTest, PlainBeforeStartThenFewerBytes) {
  RunRanks(3, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    const int world = group->size();
    const std::vector<MatrixShape> shapes = {{64, 32}, {64, 1}, {3, 3}, {3, 1}};
    const size_t total = 64 * 32 + 64 + 9 + 3;
    PowerSgdOptions options;
    options.start_powersgd_iter = 2;
    ReducerOptions reducer_options;
    reducer_options.rebuild_buckets = false;  // No broadcast to count.
    auto [hook, reducer] = MakeReducer(group, options, shapes, reducer_options);
    RANK_CHECK(reducer->buckets().size() == 1);
    // Scratch: the 76 uncompressed elements and P (64) packed, Q (32), the
    // residual (64 x 32).
    RANK_CHECK(hook->scratch_bytes() == (76 + 64 + 32 + 64 * 32) * 4);
    RANK_CHECK(reducer->grad_bytes() == total * 4 + hook->scratch_bytes());
    const uint64_t plain = WireBytes(Traffic::kAllReduce, total * 4, world);
    const uint64_t compressed = WireBytes(Traffic::kAllReduce, 140 * 4, world) +
                                WireBytes(Traffic::kAllReduce, 32 * 4, world);
    for (int t = 0; t < 3; ++t) {
      std::vector<Grads> all;
      for (int r = 0; r < world; ++r) {
        all.push_back(RankGrads(shapes, r, t, /*exact=*/true));
      }
      absl::StatusOr<Grads> out = Step(*reducer, all[group->rank()]);
      RANK_OK(out.status());
      for (int p = 0; p < 4; ++p) {
        if (p == 0 && t == 2) continue;  // Compressed.
        RANK_OK(ExpectEqual((*out)[p], ExactAverage(all, p),
                            absl::StrCat("iteration ", t, " param ", p)));
      }
      const uint64_t want =
          (t + 1 < 3 ? (t + 1) * plain : 2 * plain + compressed);
      RANK_CHECK(*hook->bytes_sent() == want);
      RANK_CHECK(reducer->bytes_communicated() == want);
      RANK_CHECK(hook->iterations() == t + 1);
    }
    RANK_CHECK(compressed * 10 < plain);
    return absl::OkStatus();
  });
}

// Error feedback. Rank r's gradient G_r is the same every iteration; the
// applied A_t (the same on every rank) and the residual e_t satisfy
// M_t = G_r + e_{t-1} (e_0 = 0) and e_t = M_t - A_t, so that
//   A_1 + ... + A_k = k G_r - e_k,
// on every rank. In f32 each M_t is one rounded addition (error <=
// u |G_r + e_{t-1}|) and each e_t one rounded subtraction (e_t = (M_t -
// A_t)(1 + b), |b| <= u, so |M_t - A_t - e_t| <= u |e_t| / (1 - u)): per
// element, |sum A_t - k G_r + e_k| <= sum_t u (|G_r + e_{t-1}| + 1.001
// |e_t|), plus the double sums' own 2^-50-relative error. Marking in
// forward order makes the rebuild move every parameter, so the residuals
// and Q's must follow them (OnLayout). The reducer's bytes add the
// rebuild's broadcast to the hook's.
TEST(PowerSgdRanksTest, ErrorFeedbackAppliesTheSumOfTheGradients) {
  RunRanks(2, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    const std::vector<MatrixShape> shapes = {{16, 12}, {16, 1}, {12, 10}};
    const int n = 3;
    PowerSgdOptions options;
    options.start_powersgd_iter = 0;
    ReducerOptions reducer_options;
    reducer_options.first_bucket_bytes = 400;
    reducer_options.bucket_cap_bytes = 400;
    auto [hook, reducer] = MakeReducer(group, options, shapes, reducer_options);
    const Grads grads = RankGrads(shapes, group->rank(), 0);
    Grads previous_error;  // e_{t-1}.
    std::vector<std::vector<double>> sum(n), limit(n);
    for (int p = 0; p < n; ++p) {
      previous_error.emplace_back(grads[p].size(), 0.0f);
      sum[p].assign(grads[p].size(), 0);
      limit[p].assign(grads[p].size(), 0);
    }
    const int kIterations = 8;
    for (int t = 1; t <= kIterations; ++t) {
      absl::StatusOr<Grads> out = Step(*reducer, grads, /*forward=*/true);
      RANK_OK(out.status());
      for (int p : {0, 2}) {
        absl::Span<const float> e = hook->error(p);
        RANK_CHECK(e.size() == grads[p].size());
        for (size_t k = 0; k < e.size(); ++k) {
          sum[p][k] += (*out)[p][k];
          limit[p][k] += kU * (std::fabs(grads[p][k] + previous_error[p][k]) +
                               1.001 * std::fabs(e[k]));
          previous_error[p][k] = e[k];
        }
      }
    }
    RANK_CHECK(reducer->rebuilt());
    // Rebuilt in the ready order 0, 1, 2 from {2}, {1, 0}: {0}, {1, 2}.
    RANK_CHECK(reducer->buckets()[0].params == std::vector<int>{0});
    for (int p : {0, 2}) {
      double residual = 0;
      for (size_t k = 0; k < grads[p].size(); ++k) {
        const double e = previous_error[p][k];
        residual = std::max(residual, std::fabs(e));
        const double gap = sum[p][k] - kIterations * double{grads[p][k]} + e;
        const double allowed =
            limit[p][k] + std::ldexp(kIterations * std::fabs(grads[p][k]) +
                                         std::fabs(sum[p][k]),
                                     -50);
        if (!(std::fabs(gap) <= allowed)) {
          return absl::InternalError(absl::StrCat(
              "param ", p, "[", k, "]: sum of applied - ", kIterations,
              " G + e = ", gap, ", beyond ", allowed));
        }
      }
      // Full-rank gradients at rank 1: something was held back.
      RANK_CHECK(residual > 1e-3);
    }
    RANK_CHECK(hook->error(1).empty());
    RANK_CHECK(reducer->bytes_communicated() ==
               *hook->bytes_sent() +
                   WireBytes(Traffic::kBroadcast, n * 4, group->size()));
    return absl::OkStatus();
  });
}

// Without error feedback nothing is kept but P and Q, and without warm
// start Q is drawn afresh every iteration: each iteration is the one-step
// approximation from that iteration's draw.
TEST(PowerSgdRanksTest, WithoutFeedbackOrWarmStartEachIterationStandsAlone) {
  RunRanks(2, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    const std::vector<MatrixShape> shapes = {{24, 16}};
    PowerSgdOptions options;
    options.start_powersgd_iter = 1;
    options.use_error_feedback = false;
    options.warm_start = false;
    options.seed = 3;
    auto [hook, reducer] = MakeReducer(group, options, shapes);
    RANK_CHECK(hook->scratch_bytes() == (24 + 16) * 4);
    for (int t = 0; t < 3; ++t) {
      std::vector<Grads> all;
      for (int r = 0; r < 2; ++r) all.push_back(RankGrads(shapes, r, t));
      absl::StatusOr<Grads> out = Step(*reducer, all[group->rank()]);
      RANK_OK(out.status());
      RANK_CHECK(hook->error(0).empty());
      if (t == 0) continue;  // Plain.
      const Reference ref =
          RankOneReference(Average(all, 0), 24, 16, InitialQ(3, 0, t, 16), 2);
      RANK_OK(ExpectNear((*out)[0], ref, absl::StrCat("iteration ", t)));
    }
    return absl::OkStatus();
  });
}

// The draw is a pure function of (seed, param, iteration), bell-shaped on
// (-2, 2): these are the values every rank and platform must get.
TEST(PowerSgdInitialQTest, IsAFunctionOfSeedParamAndIteration) {
  const std::vector<float> a = InitialQ(1, 2, 3, 1000);
  // Integer and exactly rounded arithmetic only: any platform's values.
  EXPECT_EQ(a[0], -0x1.d8b592p-4f);
  EXPECT_EQ(a[1], -0x1.a6a91cp-2f);
  EXPECT_EQ(a[2], 0x1.8cd912p-1f);
  EXPECT_EQ(a, InitialQ(1, 2, 3, 1000));
  EXPECT_NE(a, InitialQ(2, 2, 3, 1000));
  EXPECT_NE(a, InitialQ(1, 3, 3, 1000));
  EXPECT_NE(a, InitialQ(1, 2, 4, 1000));
  double mean = 0, var = 0;
  for (float x : a) {
    EXPECT_GT(x, -2.0f);
    EXPECT_LT(x, 2.0f);
    mean += x / 1000.0;
    var += x * x / 1000.0;
  }
  // The sum of 4 uniforms less 2 has mean 0 and variance 1/3; over 1000
  // draws the sample mean's standard deviation is 0.018, so 0.1 is 5.5
  // sigma.
  EXPECT_NEAR(mean, 0, 0.1);
  EXPECT_NEAR(var, 1.0 / 3, 0.1);
}

}  // namespace
}  // namespace cohort

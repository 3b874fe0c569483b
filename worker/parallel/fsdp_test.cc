#include "worker/parallel/fsdp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/collective/testing/ranks.h"
#include "worker/parallel/optimizer.h"

namespace cohort {
namespace {

using ::cohort::testing::ReadFloats;
using ::cohort::testing::RunRanks;
using ::cohort::testing::TempPath;
using ::cohort::testing::WriteFloats;

// A tiny MLP: 6 -> 5 -> 5 -> 3, tanh between layers, MSE loss, one FSDP
// unit per layer. The units' flat sizes (35, 30, 18) are not multiples of
// 2 or 4, so padding is exercised.

constexpr int kDims[] = {6, 5, 5, 3};
constexpr int kLayers = 3;
constexpr int kGlobalBatch = 8;
constexpr int kSteps = 5;

using Batch = std::vector<std::vector<float>>;  // [sample][feature]

// Deterministic values in [-1, 1) from a 64-bit LCG.
class Numbers {
 public:
  explicit Numbers(uint64_t seed) : state_(seed * 6364136223846793005ULL + 1) {}
  float Next() {
    state_ = state_ * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<float>((state_ >> 40) % 2000001) / 1000000.0f - 1.0f;
  }

 private:
  uint64_t state_;
};

std::vector<std::vector<size_t>> ModelUnits() {
  std::vector<std::vector<size_t>> units;
  for (int l = 0; l < kLayers; ++l) {
    units.push_back({static_cast<size_t>(kDims[l + 1] * kDims[l]),
                     static_cast<size_t>(kDims[l + 1])});
  }
  return units;
}

// params[l] = {W (out x in, row-major), b}.
std::vector<std::vector<std::vector<float>>> InitialParams() {
  Numbers n(7);
  std::vector<std::vector<std::vector<float>>> params;
  for (const auto& unit : ModelUnits()) {
    params.emplace_back();
    for (size_t count : unit) {
      std::vector<float> p(count);
      for (float& v : p) v = 0.5f * n.Next();
      params.back().push_back(std::move(p));
    }
  }
  return params;
}

// The global batch of `step`; rank r of N takes samples r, r + N, ...
void MakeBatch(int step, int rank, int world, Batch& x, Batch& t) {
  Numbers n(1000 + step);
  x.clear();
  t.clear();
  for (int s = 0; s < kGlobalBatch; ++s) {
    std::vector<float> xs(kDims[0]), ts(kDims[kLayers]);
    for (float& v : xs) v = n.Next();
    for (float& v : ts) v = n.Next();
    if (s % world == rank) {
      x.push_back(std::move(xs));
      t.push_back(std::move(ts));
    }
  }
}

// z = W a + b; then tanh except for the last layer.
Batch LayerForward(int l, absl::Span<const float> w, absl::Span<const float> b,
                   const Batch& a) {
  const int in = kDims[l], out = kDims[l + 1];
  Batch z(a.size(), std::vector<float>(out));
  for (size_t s = 0; s < a.size(); ++s) {
    for (int o = 0; o < out; ++o) {
      float acc = b[o];
      for (int i = 0; i < in; ++i) acc += w[o * in + i] * a[s][i];
      z[s][o] = l + 1 < kLayers ? std::tanh(acc) : acc;
    }
  }
  return z;
}

// Given dz (the gradient at layer l's pre-activation), adds into gw, gb
// and returns the gradient at layer l-1's pre-activation (through tanh).
Batch LayerBackward(int l, absl::Span<const float> w, const Batch& a,
                    const Batch& dz, absl::Span<float> gw,
                    absl::Span<float> gb) {
  const int in = kDims[l], out = kDims[l + 1];
  Batch da(a.size(), std::vector<float>(in, 0.0f));
  for (size_t s = 0; s < a.size(); ++s) {
    for (int o = 0; o < out; ++o) {
      gb[o] += dz[s][o];
      for (int i = 0; i < in; ++i) {
        gw[o * in + i] += dz[s][o] * a[s][i];
        da[s][i] += w[o * in + i] * dz[s][o];
      }
    }
    // a = tanh(previous z), so d tanh = 1 - a^2.
    for (int i = 0; i < in; ++i) da[s][i] *= 1.0f - a[s][i] * a[s][i];
  }
  return da;
}

// d(mean over the batch of sum (y - t)^2) / dy.
Batch LossGradient(const Batch& y, const Batch& t) {
  Batch dy = y;
  for (size_t s = 0; s < y.size(); ++s) {
    for (size_t o = 0; o < y[s].size(); ++o) {
      dy[s][o] = 2.0f * (y[s][o] - t[s][o]) / static_cast<float>(y.size());
    }
  }
  return dy;
}

enum class Opt { kSgd, kAdam };

std::unique_ptr<Optimizer> MakeOptimizer(Opt opt) {
  if (opt == Opt::kSgd) {
    return NewSgd({.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f})
        .value();
  }
  return NewAdam({.lr = 0.01f, .weight_decay = 0.01f}).value();
}

// The reference: one process, the whole global batch, every parameter a
// tensor of its own. Returns the final parameters, flat unit by unit.
std::vector<float> TrainLocally(Opt opt_kind) {
  auto params = InitialParams();
  std::unique_ptr<Optimizer> opt = MakeOptimizer(opt_kind);
  for (int step = 0; step < kSteps; ++step) {
    Batch x, t;
    MakeBatch(step, 0, 1, x, t);
    std::vector<Batch> acts = {x};
    for (int l = 0; l < kLayers; ++l) {
      acts.push_back(LayerForward(l, params[l][0], params[l][1], acts[l]));
    }
    Batch dz = LossGradient(acts[kLayers], t);
    std::vector<std::vector<std::vector<float>>> grads(kLayers);
    for (int l = kLayers - 1; l >= 0; --l) {
      grads[l] = {std::vector<float>(params[l][0].size()),
                  std::vector<float>(params[l][1].size())};
      dz = LayerBackward(l, params[l][0], acts[l], dz,
                         absl::MakeSpan(grads[l][0]),
                         absl::MakeSpan(grads[l][1]));
    }
    for (int l = 0; l < kLayers; ++l) {
      for (int i = 0; i < 2; ++i) {
        EXPECT_TRUE(
            opt->Step(2 * l + i, absl::MakeSpan(params[l][i]), grads[l][i])
                .ok());
      }
    }
  }
  std::vector<float> flat;
  for (const auto& unit : params) {
    for (const auto& p : unit) flat.insert(flat.end(), p.begin(), p.end());
  }
  return flat;
}

// One forward and backward of this rank's part of `step`'s batch.
absl::Status ForwardBackward(Fsdp& fsdp, int step) {
  const int rank = fsdp.group().rank(), world = fsdp.group().size();
  Batch x, t;
  MakeBatch(step, rank, world, x, t);
  std::vector<Batch> acts = {x};
  for (int l = 0; l < kLayers; ++l) {
    RANK_OK(fsdp.BeginForward(l));
    RANK_CHECK(fsdp.param(l, 0).size() == ModelUnits()[l][0]);
    acts.push_back(
        LayerForward(l, fsdp.param(l, 0), fsdp.param(l, 1), acts[l]));
    RANK_OK(fsdp.EndForward(l));
  }
  Batch dz = LossGradient(acts[kLayers], t);
  for (int l = kLayers - 1; l >= 0; --l) {
    RANK_OK(fsdp.BeginBackward(l));
    dz = LayerBackward(l, fsdp.param(l, 0), acts[l], dz, fsdp.grad(l, 0),
                       fsdp.grad(l, 1));
    RANK_OK(fsdp.EndBackward(l));
  }
  return fsdp.FinishBackward();
}

// Loads the initial parameters from rank 0: the other ranks pass zeros of
// the right sizes, which must be ignored.
absl::Status LoadInitial(Fsdp& fsdp) {
  auto params = InitialParams();
  std::vector<std::vector<absl::Span<const float>>> values;
  for (auto& unit : params) {
    values.emplace_back();
    for (auto& p : unit) {
      if (fsdp.group().rank() != 0) std::fill(p.begin(), p.end(), 0.0f);
      values.back().push_back(p);
    }
  }
  return fsdp.LoadFromRank0(values);
}

absl::StatusOr<std::vector<float>> TrainFsdp(
    std::shared_ptr<ProcessGroup> group, const FsdpOptions& options,
    Opt opt_kind) {
  auto fsdp = Fsdp::Create(group, ModelUnits(), options);
  if (!fsdp.ok()) return fsdp.status();
  RANK_OK(LoadInitial(**fsdp));
  std::unique_ptr<Optimizer> opt = MakeOptimizer(opt_kind);
  for (int step = 0; step < kSteps; ++step) {
    RANK_OK(ForwardBackward(**fsdp, step));
    RANK_OK((*fsdp)->Step(*opt));
    (*fsdp)->ZeroGrad();
  }
  std::vector<float> flat;
  for (int u = 0; u < kLayers; ++u) {
    auto full = (*fsdp)->GatherFullParams(u);
    if (!full.ok()) return full.status();
    flat.insert(flat.end(), full->begin(), full->end());
  }
  const FsdpMemory m = (*fsdp)->memory();
  RANK_CHECK(m.gathered_param_bytes == 0 && m.gathered_grad_bytes == 0);
  return flat;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float tolerance = 1e-6f + 1e-5f * std::abs(want[i]);
    if (!(std::abs(got[i] - want[i]) <= tolerance) && bad++ < 5) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i]
                    << ", the reference " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

class FsdpMatchesLocalTraining
    : public ::testing::TestWithParam<std::tuple<ShardingStrategy, int, int>> {
};

TEST_P(FsdpMatchesLocalTraining, SgdAndAdam) {
  const auto [strategy, world, depth] = GetParam();
  const FsdpOptions options{.strategy = strategy, .prefetch_depth = depth};
  const std::string sgd_path = TempPath("sgd"), adam_path = TempPath("adam");
  RunRanks(world, [&](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    for (Opt opt : {Opt::kSgd, Opt::kAdam}) {
      auto flat = TrainFsdp(group, options, opt);
      if (!flat.ok()) return flat.status();
      if (group->rank() == 0) {
        RANK_OK(WriteFloats(opt == Opt::kSgd ? sgd_path : adam_path, *flat));
      }
    }
    return absl::OkStatus();
  });
  const std::string what = absl::StrCat(ShardingStrategyName(strategy),
                                        " world ", world, " prefetch ", depth);
  auto sgd = ReadFloats(sgd_path);
  ASSERT_TRUE(sgd.ok()) << sgd.status();
  ExpectClose(*sgd, TrainLocally(Opt::kSgd), what + " sgd");
  auto adam = ReadFloats(adam_path);
  ASSERT_TRUE(adam.ok()) << adam.status();
  ExpectClose(*adam, TrainLocally(Opt::kAdam), what + " adam");
  // Training moved the parameters: the comparison is not vacuous.
  std::vector<float> initial;
  for (const auto& unit : InitialParams()) {
    for (const auto& p : unit)
      initial.insert(initial.end(), p.begin(), p.end());
  }
  ASSERT_EQ(initial.size(), adam->size());
  EXPECT_GT(std::abs((*adam)[0] - initial[0]), 1e-3f);
  EXPECT_GT(std::abs((*sgd)[0] - initial[0]), 1e-3f);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, FsdpMatchesLocalTraining,
    ::testing::Values(std::make_tuple(ShardingStrategy::kFullShard, 1, 1),
                      std::make_tuple(ShardingStrategy::kFullShard, 2, 1),
                      std::make_tuple(ShardingStrategy::kFullShard, 4, 1),
                      std::make_tuple(ShardingStrategy::kFullShard, 2, 0),
                      std::make_tuple(ShardingStrategy::kFullShard, 2, 2),
                      std::make_tuple(ShardingStrategy::kFullShard, 4, 3),
                      std::make_tuple(ShardingStrategy::kShardGradOp, 1, 1),
                      std::make_tuple(ShardingStrategy::kShardGradOp, 2, 1),
                      std::make_tuple(ShardingStrategy::kShardGradOp, 2, 2),
                      std::make_tuple(ShardingStrategy::kShardGradOp, 4, 1),
                      std::make_tuple(ShardingStrategy::kNoShard, 1, 1),
                      std::make_tuple(ShardingStrategy::kNoShard, 2, 1),
                      std::make_tuple(ShardingStrategy::kNoShard, 4, 1)),
    [](const ::testing::TestParamInfo<FsdpMatchesLocalTraining::ParamType>&
           info) {
      return absl::StrCat(ShardingStrategyName(std::get<0>(info.param)),
                          "_world", std::get<1>(info.param), "_prefetch",
                          std::get<2>(info.param));
    });

// Two backwards before one Step accumulate: the gradient shard is the sum
// of the two backwards' shards, and each is rank r's slice of the
// reference gradient (the mean over the global batch), padding zero.
TEST(FsdpTest, GradientsAccumulateUntilZeroGrad) {
  constexpr int kWorld = 2;
  std::vector<std::string> paths;
  for (int r = 0; r < kWorld; ++r) paths.push_back(TempPath("grads"));
  RunRanks(kWorld, [&](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    auto fsdp = Fsdp::Create(group, ModelUnits()).value();
    RANK_OK(LoadInitial(*fsdp));
    std::vector<std::vector<float>> first, second;
    RANK_OK(ForwardBackward(*fsdp, 0));
    for (int u = 0; u < kLayers; ++u) {
      auto g = fsdp->grad_shard(u);
      first.emplace_back(g.begin(), g.end());
    }
    fsdp->ZeroGrad();
    RANK_OK(ForwardBackward(*fsdp, 1));
    for (int u = 0; u < kLayers; ++u) {
      auto g = fsdp->grad_shard(u);
      second.emplace_back(g.begin(), g.end());
    }
    fsdp->ZeroGrad();
    for (int u = 0; u < kLayers; ++u) {
      for (float g : fsdp->grad_shard(u)) RANK_CHECK(g == 0.0f);
    }
    RANK_OK(ForwardBackward(*fsdp, 0));
    RANK_OK(ForwardBackward(*fsdp, 1));
    std::vector<float> out;
    for (int u = 0; u < kLayers; ++u) {
      auto g = fsdp->grad_shard(u);
      RANK_CHECK(g.size() == fsdp->shard_elements(u));
      for (size_t i = 0; i < g.size(); ++i) {
        RANK_CHECK(g[i] == first[u][i] + second[u][i]);
      }
      out.insert(out.end(), first[u].begin(), first[u].end());
    }
    return WriteFloats(paths[group->rank()], out);
  });
  // The reference gradient of step 0's global batch, padded per unit.
  auto params = InitialParams();
  Batch x, t;
  MakeBatch(0, 0, 1, x, t);
  std::vector<Batch> acts = {x};
  for (int l = 0; l < kLayers; ++l) {
    acts.push_back(LayerForward(l, params[l][0], params[l][1], acts[l]));
  }
  Batch dz = LossGradient(acts[kLayers], t);
  std::vector<std::vector<float>> flat(kLayers);
  for (int l = kLayers - 1; l >= 0; --l) {
    const size_t nw = params[l][0].size(), nb = params[l][1].size();
    const size_t padded = (nw + nb + kWorld - 1) / kWorld * kWorld;
    flat[l].assign(padded, 0.0f);
    dz = LayerBackward(l, params[l][0], acts[l], dz,
                       absl::MakeSpan(flat[l]).subspan(0, nw),
                       absl::MakeSpan(flat[l]).subspan(nw, nb));
  }
  for (int r = 0; r < kWorld; ++r) {
    std::vector<float> want;
    for (const auto& unit : flat) {
      const size_t shard = unit.size() / kWorld;
      want.insert(want.end(), unit.begin() + r * shard,
                  unit.begin() + (r + 1) * shard);
    }
    auto got = ReadFloats(paths[r]);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectClose(*got, want, absl::StrCat("rank ", r, " gradient shard"));
  }
}

// Memory accounting, on four equal units of 53 elements (padded to 54 for
// two ranks, 56 for four).

constexpr int kMemUnits = 4;
constexpr size_t kMemUnitSize = 53;

std::vector<std::vector<size_t>> MemoryUnits() {
  return std::vector<std::vector<size_t>>(kMemUnits, {40, 13});
}

// Every rank runs two steps of Adam with made-up gradients and reports:
// param, grad, optimizer, gathered param and grad bytes after the second
// FinishBackward; the gathered param bytes right after BeginForward(0);
// the peak; then bytes_communicated.
std::vector<float> MemoryFigures(ShardingStrategy strategy, int world) {
  const std::string path = TempPath("memory");
  RunRanks(world, [&](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    auto fsdp = Fsdp::Create(group, MemoryUnits(), {.strategy = strategy});
    if (!fsdp.ok()) return fsdp.status();
    Fsdp& f = **fsdp;
    auto opt = NewAdam({}).value();
    float gathered_in_forward = 0;
    for (int step = 0; step < 2; ++step) {
      for (int u = 0; u < kMemUnits; ++u) {
        RANK_OK(f.BeginForward(u));
        if (u == 0) gathered_in_forward = f.memory().gathered_param_bytes;
        RANK_OK(f.EndForward(u));
      }
      for (int u = kMemUnits - 1; u >= 0; --u) {
        RANK_OK(f.BeginBackward(u));
        for (int i = 0; i < 2; ++i) {
          for (float& g : f.grad(u, i)) g = 0.25f * (u + 1);
        }
        RANK_OK(f.EndBackward(u));
      }
      RANK_OK(f.FinishBackward());
      if (step == 0) RANK_OK(f.Step(*opt));
    }
    const FsdpMemory m = f.memory();
    if (group->rank() != 0) return absl::OkStatus();
    return WriteFloats(
        path,
        {static_cast<float>(m.param_bytes), static_cast<float>(m.grad_bytes),
         static_cast<float>(m.optimizer_bytes),
         static_cast<float>(m.gathered_param_bytes),
         static_cast<float>(m.gathered_grad_bytes), gathered_in_forward,
         static_cast<float>(m.peak_bytes),
         static_cast<float>(f.bytes_communicated())});
  });
  auto figures = ReadFloats(path);
  EXPECT_TRUE(figures.ok()) << figures.status();
  if (!figures.ok() || figures->size() != 8) return std::vector<float>(8, -1);
  return *figures;
}

class FsdpMemoryTest : public ::testing::TestWithParam<int> {};

TEST_P(FsdpMemoryTest, FullShardHoldsAboutOneNth) {
  const int world = GetParam();
  const size_t padded = (kMemUnitSize + world - 1) / world * world;
  const size_t shard_bytes = padded / world * sizeof(float);
  const size_t unit_bytes = padded * sizeof(float);
  const std::vector<float> full =
      MemoryFigures(ShardingStrategy::kFullShard, world);
  EXPECT_EQ(full[0], kMemUnits * shard_bytes) << "param_bytes";
  EXPECT_EQ(full[1], kMemUnits * shard_bytes) << "grad_bytes";
  EXPECT_EQ(full[2], 2 * full[0]) << "optimizer_bytes: Adam's m and v";
  EXPECT_EQ(full[3], 0) << "gathered_param_bytes after FinishBackward";
  EXPECT_EQ(full[4], 0) << "gathered_grad_bytes after FinishBackward";
  // Unit 0 and the prefetch of unit 1.
  EXPECT_EQ(full[5], 2 * unit_bytes) << "gathered in forward";
  // At most two units' parameters (one computing, one prefetched) and two
  // full gradients with their reduce_scatter outputs are alive at once.
  const float persistent = full[0] + full[1] + full[2];
  EXPECT_LE(full[6], persistent + 4 * unit_bytes + 2 * shard_bytes)
      << "peak_bytes";
  EXPECT_GT(full[6], persistent) << "peak_bytes";
  const float unsharded_total = 4.0f * kMemUnits * kMemUnitSize * sizeof(float);
  if (world == 4) {
    EXPECT_LT(full[6], unsharded_total) << "peak_bytes";
  }

  const std::vector<float> grad_op =
      MemoryFigures(ShardingStrategy::kShardGradOp, world);
  EXPECT_EQ(grad_op[0], full[0]);
  EXPECT_EQ(grad_op[3], 0);
  EXPECT_GT(grad_op[6], full[6])
      << "SHARD_GRAD_OP keeps every unit gathered from forward to backward";

  const std::vector<float> no_shard =
      MemoryFigures(ShardingStrategy::kNoShard, world);
  EXPECT_EQ(no_shard[0], kMemUnits * kMemUnitSize * sizeof(float));
  EXPECT_EQ(no_shard[2], 2 * no_shard[0]);
  EXPECT_EQ(no_shard[5], 0) << "NO_SHARD never gathers";
  // With one rank the shards are whole and gathering only adds copies.
  if (world > 1) {
    EXPECT_GT(no_shard[6], full[6]);
  }
  // Per step FULL_SHARD runs 4 + 3 all_gathers (the last unit stays for
  // backward) and 4 reduce_scatters of a unit each, (n-1)/n of it sent by
  // every rank; NO_SHARD all_reduces the gradients only, 2(n-1)/n of them.
  EXPECT_EQ(full[7],
            2 * (7 + 4) * WireBytes(Traffic::kAllGather, unit_bytes, world));
  EXPECT_EQ(no_shard[7], 2 * kMemUnits *
                             WireBytes(Traffic::kAllReduce,
                                       kMemUnitSize * sizeof(float), world));
}

INSTANTIATE_TEST_SUITE_P(Worlds, FsdpMemoryTest, ::testing::Values(1, 2, 4));

// Sequence and argument errors, against a one-rank group in this process
// that can be told to fail its collectives.

class LocalGroup : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::shared_ptr<Work> Broadcast(BufferView, int) override { return Op(); }
  std::shared_ptr<Work> AllReduce(BufferView, ReduceOp) override {
    return Op();
  }
  std::shared_ptr<Work> Reduce(BufferView, int, ReduceOp) override {
    return Op();
  }
  std::shared_ptr<Work> AllGather(BufferView in, BufferView out) override {
    ++all_gathers;
    return Copy(in, out);
  }
  std::shared_ptr<Work> AllGatherV(BufferView in, BufferView out,
                                   absl::Span<const size_t>) override {
    return Copy(in, out);
  }
  std::shared_ptr<Work> Gather(BufferView in, BufferView out, int) override {
    return Copy(in, out);
  }
  std::shared_ptr<Work> Scatter(BufferView in, BufferView out, int) override {
    return Copy(in, out);
  }
  std::shared_ptr<Work> AllToAll(BufferView in, BufferView out) override {
    return Copy(in, out);
  }
  std::shared_ptr<Work> AllToAllV(BufferView in, absl::Span<const size_t>,
                                  BufferView out,
                                  absl::Span<const size_t>) override {
    return Copy(in, out);
  }
  std::shared_ptr<Work> ReduceScatter(BufferView in, BufferView out,
                                      ReduceOp) override {
    return Copy(in, out);
  }
  std::shared_ptr<Work> Barrier() override { return Op(); }
  std::shared_ptr<Work> Send(BufferView, int, uint32_t) override {
    return Work::Done(absl::InvalidArgumentError("one rank"));
  }
  std::shared_ptr<Work> Recv(BufferView, int, uint32_t) override {
    return Work::Done(absl::InvalidArgumentError("one rank"));
  }

  // Collectives from now on end with UNAVAILABLE.
  void Break() { broken_ = true; }

  int all_gathers = 0;  // Issued so far.

 private:
  std::shared_ptr<Work> Op() {
    return Work::Done(broken_ ? absl::UnavailableError("peer 1 died")
                              : absl::OkStatus());
  }
  std::shared_ptr<Work> Copy(BufferView in, BufferView out) {
    if (!broken_) std::memcpy(out.data, in.data, in.bytes());
    return Op();
  }
  bool broken_ = false;
};

void ExpectCode(const absl::Status& status, absl::StatusCode code,
                absl::string_view mentions) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), mentions))
      << status << " should mention " << mentions;
}

// Ranks that group their parameters into different units fail at Create on
// every rank, naming the rank that differs.
TEST(FsdpRanksTest, CreateRejectsRanksWithDifferentUnits) {
  RunRanks(2, [](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    std::vector<std::vector<size_t>> units = {{6, 2}, {4}};
    if (group->rank() == 1) units = {{6}, {2, 4}};
    absl::Status status = Fsdp::Create(group, units).status();
    if (status.code() != absl::StatusCode::kInvalidArgument ||
        !absl::StrContains(status.message(), "rank 1's parameter sizes")) {
      return absl::InternalError(absl::StrCat(
          "want INVALID_ARGUMENT naming rank 1, got ", status.ToString()));
    }
    return Fsdp::Create(group, {{6, 2}, {4}}).status();
  });
}

TEST(FsdpTest, ParseShardingStrategy) {
  for (ShardingStrategy s :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard}) {
    auto parsed = ParseShardingStrategy(ShardingStrategyName(s));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, s);
  }
  EXPECT_EQ(ShardingStrategyName(ShardingStrategy::kShardGradOp),
            "shard_grad_op");
  EXPECT_EQ(ParseShardingStrategy("FULL_SHARD").value(),
            ShardingStrategy::kFullShard);
  ExpectCode(ParseShardingStrategy("hybrid_shard").status(),
             absl::StatusCode::kInvalidArgument, "hybrid_shard");
  ExpectCode(ParseShardingStrategy("").status(),
             absl::StatusCode::kInvalidArgument, "full_shard");
}

TEST(FsdpTest, CreateValidatesArguments) {
  auto group = std::make_shared<LocalGroup>();
  ExpectCode(Fsdp::Create(group, {}).status(),
             absl::StatusCode::kInvalidArgument, "no units");
  ExpectCode(Fsdp::Create(group, {{3}, {}}).status(),
             absl::StatusCode::kInvalidArgument, "unit 1");
  ExpectCode(Fsdp::Create(group, {{3, 0}}).status(),
             absl::StatusCode::kInvalidArgument, "parameter 1");
  ExpectCode(Fsdp::Create(nullptr, {{3}}).status(),
             absl::StatusCode::kInvalidArgument, "null");
  auto fsdp = Fsdp::Create(group, {{3, 4}, {5}}).value();
  EXPECT_EQ(fsdp->num_units(), 2);
  EXPECT_EQ(fsdp->num_params(0), 2);
  EXPECT_EQ(fsdp->unpadded_elements(0), 7u);
  EXPECT_EQ(fsdp->padded_elements(0), 7u);
  EXPECT_EQ(fsdp->shard_elements(1), 5u);
  EXPECT_EQ(fsdp->num_params(2), 0);
}

TEST(FsdpTest, LoadFromRank0ChecksSizes) {
  auto fsdp = Fsdp::Create(std::make_shared<LocalGroup>(), {{3, 2}}).value();
  std::vector<float> three(3, 1.0f), two(2, 2.0f), four(4);
  ExpectCode(fsdp->LoadFromRank0({}), absl::StatusCode::kInvalidArgument,
             "the model has 1");
  ExpectCode(fsdp->LoadFromRank0({{three}}), absl::StatusCode::kInvalidArgument,
             "unit 0");
  ExpectCode(fsdp->LoadFromRank0({{three, four}}),
             absl::StatusCode::kInvalidArgument, "parameter 1");
  ASSERT_TRUE(fsdp->LoadFromRank0({{three, two}}).ok());
  EXPECT_EQ(fsdp->GatherFullParams(0).value(),
            (std::vector<float>{1, 1, 1, 2, 2}));
}

TEST(FsdpTest, CallsOutOfSequence) {
  auto fsdp =
      Fsdp::Create(std::make_shared<LocalGroup>(), {{3, 2}, {4}}).value();
  const auto kPre = absl::StatusCode::kFailedPrecondition;
  ExpectCode(fsdp->EndForward(0), kPre, "BeginForward(0)");
  ExpectCode(fsdp->EndBackward(1), kPre, "BeginBackward(1)");
  ExpectCode(fsdp->FinishBackward(), kPre, "no EndBackward");
  ExpectCode(fsdp->BeginForward(2), absl::StatusCode::kInvalidArgument,
             "out of range");
  ExpectCode(fsdp->BeginBackward(-1), absl::StatusCode::kInvalidArgument,
             "out of range");
  // The span accessors have no status: misuse is a bug that aborts.
  EXPECT_DEATH(fsdp->param(0, 0), "param\\(0, 0\\): unit 0 is not gathered");
  EXPECT_DEATH(fsdp->grad(0, 0), "unit 0 is not in its backward");
  EXPECT_DEATH(fsdp->param_shard(5), "param_shard\\(5\\): no such unit");
  EXPECT_DEATH(fsdp->grad_shard(-1), "grad_shard\\(-1\\): no such unit");

  ASSERT_TRUE(fsdp->BeginForward(0).ok());
  EXPECT_EQ(fsdp->param(0, 1).size(), 2u);
  EXPECT_DEATH(fsdp->param(0, 2), "no such parameter");
  ExpectCode(fsdp->BeginForward(0), kPre, "EndForward");
  ExpectCode(fsdp->BeginBackward(0), kPre, "EndForward");
  EXPECT_DEATH(fsdp->grad(0, 0), "not in its backward")
      << "forward, not backward";
  auto sgd = NewSgd({}).value();
  ExpectCode(fsdp->Step(*sgd), kPre, "EndForward(0)");
  ExpectCode(fsdp->FinishBackward(), kPre, "EndForward(0)");
  ASSERT_TRUE(fsdp->EndForward(0).ok());
  EXPECT_DEATH(fsdp->param(0, 0), "not gathered") << "FULL_SHARD freed it";

  ASSERT_TRUE(fsdp->BeginBackward(1).ok());
  EXPECT_EQ(fsdp->grad(1, 0).size(), 4u);
  ExpectCode(fsdp->EndForward(1), kPre, "BeginForward(1)");
  ASSERT_TRUE(fsdp->EndBackward(1).ok());
  EXPECT_DEATH(fsdp->grad(1, 0), "not in its backward") << "after EndBackward";
  ExpectCode(fsdp->Step(*sgd), kPre, "FinishBackward");
  ASSERT_TRUE(fsdp->FinishBackward().ok());
  EXPECT_TRUE(fsdp->Step(*sgd).ok());
}

TEST(FsdpTest, FailedCollectiveMakesLaterCallsFail) {
  auto group = std::make_shared<LocalGroup>();
  auto fsdp = Fsdp::Create(group, {{3}, {4}}, {.prefetch_depth = 0}).value();
  ASSERT_TRUE(fsdp->BeginForward(0).ok());
  ASSERT_TRUE(fsdp->EndForward(0).ok());
  group->Break();
  absl::Status status = fsdp->BeginForward(1);
  ExpectCode(status, absl::StatusCode::kUnavailable, "peer 1 died");
  ExpectCode(fsdp->BeginForward(1), absl::StatusCode::kFailedPrecondition,
             "peer 1 died");
  ExpectCode(fsdp->GatherFullParams(0).status(),
             absl::StatusCode::kFailedPrecondition, "all_gather of unit 1");
}

TEST(FsdpTest, CreateRejectsNegativePrefetchDepth) {
  ExpectCode(Fsdp::Create(std::make_shared<LocalGroup>(), {{3}, {4}},
                          {.prefetch_depth = -1})
                 .status(),
             absl::StatusCode::kInvalidArgument, "prefetch_depth");
}

// prefetch_depth k: BeginForward(u) leaves units u .. u+k gathered or in
// flight, BeginBackward(u) units u-k .. u; a unit is never gathered twice
// for one Begin*, so a step issues the same all_gathers at every depth,
// only earlier. Under FULL_SHARD at most k + 1 units are held at once.
class FsdpPrefetchDepthTest : public ::testing::TestWithParam<int> {};

TEST_P(FsdpPrefetchDepthTest, GathersUpToDepthUnitsAhead) {
  const int depth = GetParam();
  constexpr int kUnits = 5;
  constexpr size_t kUnitBytes = 6 * sizeof(float);
  auto group = std::make_shared<LocalGroup>();
  auto fsdp = Fsdp::Create(group, std::vector<std::vector<size_t>>(kUnits, {6}),
                           {.prefetch_depth = depth})
                  .value();
  // Units gathered (or in flight) once Begin*(u) returns, and the
  // all_gathers issued so far.
  auto held_after = [&](int u, int direction) {
    return direction > 0 ? std::min(kUnits - u, depth + 1)
                         : std::min(u + 1, depth + 1);
  };
  for (int step = 0; step < 2; ++step) {
    const int gathers_before = group->all_gathers;
    for (int u = 0; u < kUnits; ++u) {
      ASSERT_TRUE(fsdp->BeginForward(u).ok());
      EXPECT_EQ(fsdp->memory().gathered_param_bytes,
                held_after(u, +1) * kUnitBytes)
          << "depth " << depth << " after BeginForward(" << u << ")";
      EXPECT_EQ(group->all_gathers - gathers_before,
                std::min(kUnits, u + 1 + depth))
          << "depth " << depth << " after BeginForward(" << u << ")";
      ASSERT_TRUE(fsdp->EndForward(u).ok());
    }
    const int forward_gathers = group->all_gathers - gathers_before;
    EXPECT_EQ(forward_gathers, kUnits);
    for (int u = kUnits - 1; u >= 0; --u) {
      ASSERT_TRUE(fsdp->BeginBackward(u).ok());
      EXPECT_EQ(fsdp->memory().gathered_param_bytes,
                held_after(u, -1) * kUnitBytes)
          << "depth " << depth << " after BeginBackward(" << u << ")";
      // The last unit stays from forward; the others are gathered again.
      EXPECT_EQ(group->all_gathers - gathers_before - forward_gathers,
                std::min(kUnits - 1, kUnits - 1 - u + depth))
          << "depth " << depth << " after BeginBackward(" << u << ")";
      ASSERT_TRUE(fsdp->EndBackward(u).ok());
    }
    ASSERT_TRUE(fsdp->FinishBackward().ok());
    EXPECT_EQ(group->all_gathers - gathers_before, 2 * kUnits - 1);
  }
  EXPECT_EQ(fsdp->peak_gathered_bytes(),
            std::min(kUnits, depth + 1) * kUnitBytes);
  EXPECT_EQ(fsdp->memory().peak_gathered_param_bytes,
            fsdp->peak_gathered_bytes());
}

INSTANTIATE_TEST_SUITE_P(Depths, FsdpPrefetchDepthTest,
                         ::testing::Values(0, 1, 2, 4, 7));

TEST(FsdpTest, ShardGradOpHoldsEveryUnitWhateverTheDepth) {
  for (int depth : {0, 2}) {
    auto fsdp = Fsdp::Create(std::make_shared<LocalGroup>(), {{6}, {6}, {6}},
                             {.strategy = ShardingStrategy::kShardGradOp,
                              .prefetch_depth = depth})
                    .value();
    for (int u = 0; u < 3; ++u) {
      ASSERT_TRUE(fsdp->BeginForward(u).ok());
      ASSERT_TRUE(fsdp->EndForward(u).ok());
    }
    EXPECT_EQ(fsdp->peak_gathered_bytes(), 3 * 6 * sizeof(float))
        << "depth " << depth;
  }
}

// Every depth issues the same collectives in the same order, so the
// parameters after training are bit-identical, not merely close.
TEST(FsdpRanksTest, PrefetchDepthDoesNotChangeResults) {
  const std::vector<int> depths = {0, 1, 2};
  std::vector<std::string> paths;
  for (size_t i = 0; i < depths.size(); ++i) paths.push_back(TempPath("depth"));
  RunRanks(2, [&](std::shared_ptr<ProcessGroup> group) -> absl::Status {
    for (size_t i = 0; i < depths.size(); ++i) {
      auto flat = TrainFsdp(group, {.prefetch_depth = depths[i]}, Opt::kAdam);
      if (!flat.ok()) return flat.status();
      if (group->rank() == 0) RANK_OK(WriteFloats(paths[i], *flat));
    }
    return absl::OkStatus();
  });
  auto reference = ReadFloats(paths[1]);
  ASSERT_TRUE(reference.ok()) << reference.status();
  for (size_t i = 0; i < depths.size(); ++i) {
    auto got = ReadFloats(paths[i]);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *reference) << "prefetch_depth " << depths[i];
  }
}

}  // namespace
}  // namespace cohort

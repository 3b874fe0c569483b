#include "worker/parallel/powersgd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>

#include "Eigen/Core"
#include "absl/strings/str_cat.h"

namespace cohort {
namespace {

using MatrixMap = Eigen::Map<Eigen::MatrixXf>;  // Column-major.

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Orthonormalizes the columns of `m` in place (Gram-Schmidt), projecting
// each column off the earlier ones twice: once leaves a column that was
// (nearly) in their span, which is rounding noise, far from orthogonal to
// them, and then P P^T would not be a projection. A column whose norm is 0
// is set to zero (its norm may underflow while its elements do not).
// Returns whether every column had a nonzero norm.
bool Orthonormalize(MatrixMap m, float epsilon) {
  bool all_nonzero = true;
  for (Eigen::Index i = 0; i < m.cols(); ++i) {
    auto col = m.col(i);
    for (int pass = 0; pass < 2; ++pass) {
      for (Eigen::Index j = 0; j < i; ++j) col -= m.col(j).dot(col) * m.col(j);
    }
    const float norm = col.stableNorm();
    if (norm == 0) {
      col.setZero();
      all_nonzero = false;
      continue;
    }
    col /= norm + epsilon;
  }
  return all_nonzero;
}

// A compressed parameter: where it is in its bucket and where its P, Q
// and residual are in the bucket's scratch.
struct Matrix {
  int param = 0;
  size_t offset = 0;  // In the bucket, elements.
  size_t rows = 0;
  size_t cols = 0;
  size_t rank = 0;
  size_t p_at = 0;       // In BucketPlan::packed.
  size_t q_at = 0;       // In BucketPlan::q.
  size_t e_at = 0;       // In BucketPlan::error.
  bool q_ready = false;  // Q holds the last iteration's (all-reduced) Q.
};

// Uncompressed elements [offset, offset + count) of a bucket.
struct Run {
  size_t offset = 0;
  size_t count = 0;
};

enum class Launched { kNone, kPlain, kCompressed };

struct BucketPlan {
  size_t elements = 0;
  std::vector<Run> runs;  // Packed first into `packed`, in order.
  size_t run_elements = 0;
  std::vector<Matrix> matrices;
  // Empty for a bucket without compressed matrices (it is all_reduced in
  // place). Else: the runs, then every P (rows x rank); every Q
  // (cols x rank); every residual (rows x cols), with error feedback.
  std::vector<float> packed;
  std::vector<float> q;
  std::vector<float> error;
  Launched launched = Launched::kNone;
};

}  // namespace

void PowerSgdInitialQ(uint64_t seed, int param, int64_t iteration,
                      absl::Span<float> q) {
  uint64_t mixed = SplitMix64(seed);
  mixed = SplitMix64(mixed ^ static_cast<uint64_t>(param));
  mixed = SplitMix64(mixed ^ static_cast<uint64_t>(iteration));
  std::mt19937_64 engine(mixed);
  for (float& value : q) {
    // Four 53-bit integers sum exactly in 64 bits; one rounding to double.
    uint64_t sum = 0;
    for (int k = 0; k < 4; ++k) sum += engine() >> 11;
    value = static_cast<float>(std::ldexp(static_cast<double>(sum), -53) - 2);
  }
}

// Thread-compatible: called only from the Reducer's thread (Launch and
// Finalize), the backend touching only the buffers of the ops in flight.
struct PowerSgdHook::State {
  PowerSgdOptions options;
  std::vector<MatrixShape> shapes;
  std::vector<size_t> ranks;  // Per parameter: r', 0 if not compressed.

  std::vector<BucketPlan> plans;
  // Per parameter, when compressed: its bucket and index in `matrices`.
  std::vector<std::pair<int, int>> where;

  int64_t iterations = 0;
  int64_t iteration = 0;  // The current one.
  bool compressing = false;
  ProcessGroup* group = nullptr;  // The last Launch's, for Finalize.
  uint64_t bytes_sent = 0;

  absl::Status CheckLayout(absl::Span<const ReducerBucket> buckets) const;
  BucketPlan Plan(const ReducerBucket& bucket) const;
  void CarryOver(const std::vector<BucketPlan>& old_plans,
                 const std::vector<std::pair<int, int>>& old_where);
  absl::Status CheckBucket(int bucket, BufferView grads,
                           const char* call) const;

  void DrawQ(const Matrix& m, MatrixMap q) const {
    PowerSgdInitialQ(options.seed, m.param, iteration,
                     absl::Span<float>(q.data(), q.size()));
    Orthonormalize(q, options.orthogonalization_epsilon);
  }
  void Compress(BucketPlan& plan, float* grads);
  absl::Status Decompress(BucketPlan& plan, float* grads);

  std::shared_ptr<Work> AllReduce(ProcessGroup& group, float* data,
                                  size_t count) {
    bytes_sent +=
        WireBytes(Traffic::kAllReduce, count * sizeof(float), group.size());
    return group.AllReduce(BufferView::Of(data, count), ReduceOp::kAvg);
  }
};

absl::Status PowerSgdHook::State::CheckLayout(
    absl::Span<const ReducerBucket> buckets) const {
  size_t count = 0;
  for (const ReducerBucket& bucket : buckets) count += bucket.params.size();
  if (count != shapes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("PowerSGD: the hook has shapes for ", shapes.size(),
                     " parameters but the Reducer's buckets hold ", count,
                     "; pass one shape per Reducer parameter, in its order"));
  }
  std::vector<bool> seen(shapes.size(), false);
  for (size_t b = 0; b < buckets.size(); ++b) {
    const ReducerBucket& bucket = buckets[b];
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const int p = bucket.params[k];
      if (p < 0 || static_cast<size_t>(p) >= shapes.size() || seen[p]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "PowerSGD: bucket ", b, " holds parameter ", p,
            ", out of range or held twice (the hook has shapes for 0..",
            shapes.size() - 1, ")"));
      }
      seen[p] = true;
      const size_t end = k + 1 < bucket.params.size() ? bucket.offsets[k + 1]
                                                      : bucket.elements;
      const size_t size = end - bucket.offsets[k];
      const MatrixShape& shape = shapes[p];
      if (size != shape.rows * shape.cols) {
        return absl::InvalidArgumentError(absl::StrCat(
            "PowerSGD: parameter ", p, " has ", size,
            " elements in the Reducer but its shape ", shape.rows, " x ",
            shape.cols, " has ", shape.rows * shape.cols,
            "; pass param_shapes in the Reducer's parameter order"));
      }
    }
  }
  return absl::OkStatus();
}

BucketPlan PowerSgdHook::State::Plan(const ReducerBucket& bucket) const {
  BucketPlan plan;
  plan.elements = bucket.elements;
  size_t q_at = 0;
  size_t e_at = 0;
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const int p = bucket.params[k];
    const size_t offset = bucket.offsets[k];
    const MatrixShape& shape = shapes[p];
    const size_t size = shape.rows * shape.cols;
    if (ranks[p] == 0) {
      if (!plan.runs.empty() &&
          plan.runs.back().offset + plan.runs.back().count == offset) {
        plan.runs.back().count += size;
      } else {
        plan.runs.push_back(Run{offset, size});
      }
      plan.run_elements += size;
      continue;
    }
    Matrix m;
    m.param = p;
    m.offset = offset;
    m.rows = shape.rows;
    m.cols = shape.cols;
    m.rank = ranks[p];
    m.q_at = q_at;
    m.e_at = e_at;
    q_at += m.cols * m.rank;
    e_at += size;
    plan.matrices.push_back(m);
  }
  if (plan.matrices.empty()) return plan;
  size_t p_at = plan.run_elements;
  for (Matrix& m : plan.matrices) {
    m.p_at = p_at;
    p_at += m.rows * m.rank;
  }
  plan.packed.assign(p_at, 0.0f);
  plan.q.assign(q_at, 0.0f);
  if (options.use_error_feedback) plan.error.assign(e_at, 0.0f);
  return plan;
}

void PowerSgdHook::State::CarryOver(
    const std::vector<BucketPlan>& old_plans,
    const std::vector<std::pair<int, int>>& old_where) {
  for (BucketPlan& plan : plans) {
    for (Matrix& m : plan.matrices) {
      const auto [b, i] = old_where[m.param];
      if (b < 0) continue;
      const BucketPlan& old_plan = old_plans[b];
      const Matrix& old = old_plan.matrices[i];
      std::copy_n(old_plan.q.begin() + old.q_at, m.cols * m.rank,
                  plan.q.begin() + m.q_at);
      m.q_ready = old.q_ready;
      if (!plan.error.empty()) {
        std::copy_n(old_plan.error.begin() + old.e_at, m.rows * m.cols,
                    plan.error.begin() + m.e_at);
      }
    }
  }
}

absl::Status PowerSgdHook::State::CheckBucket(int bucket, BufferView grads,
                                              const char* call) const {
  if (bucket < 0 || static_cast<size_t>(bucket) >= plans.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "PowerSGD: ", call, " for bucket ", bucket, ", but the layout has ",
        plans.size(),
        " buckets (OnLayout announces them; the Reducer calls it)"));
  }
  if (grads.dtype != Dtype::kF32 || (grads.data == nullptr && grads.count)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PowerSGD: ", call, ": bucket ", bucket,
        " must be a non-null f32 buffer, got ", DtypeName(grads.dtype)));
  }
  if (grads.count != plans[bucket].elements) {
    return absl::FailedPreconditionError(absl::StrCat(
        "PowerSGD: ", call, ": bucket ", bucket, " has ", grads.count,
        " elements, but the layout's has ", plans[bucket].elements));
  }
  return absl::OkStatus();
}

void PowerSgdHook::State::Compress(BucketPlan& plan, float* grads) {
  size_t at = 0;
  for (const Run& run : plan.runs) {
    std::memcpy(plan.packed.data() + at, grads + run.offset,
                run.count * sizeof(float));
    at += run.count;
  }
  for (Matrix& m : plan.matrices) {
    MatrixMap M(grads + m.offset, m.rows, m.cols);
    if (!plan.error.empty()) {
      M += MatrixMap(plan.error.data() + m.e_at, m.rows, m.cols);
    }
    MatrixMap Q(plan.q.data() + m.q_at, m.cols, m.rank);
    if (!options.warm_start || !m.q_ready ||
        !Orthonormalize(Q, options.orthogonalization_epsilon)) {
      // A warm-start column that vanished would stay zero for good.
      DrawQ(m, Q);
    }
    MatrixMap P(plan.packed.data() + m.p_at, m.rows, m.rank);
    P.noalias() = M * Q;
  }
}

absl::Status PowerSgdHook::State::Decompress(BucketPlan& plan, float* grads) {
  size_t at = 0;
  for (const Run& run : plan.runs) {
    std::memcpy(grads + run.offset, plan.packed.data() + at,
                run.count * sizeof(float));
    at += run.count;
  }
  for (const Matrix& m : plan.matrices) {
    MatrixMap P(plan.packed.data() + m.p_at, m.rows, m.rank);
    Orthonormalize(P, options.orthogonalization_epsilon);
    MatrixMap Q(plan.q.data() + m.q_at, m.cols, m.rank);
    Q.noalias() = MatrixMap(grads + m.offset, m.rows, m.cols).transpose() * P;
  }
  absl::Status status = AllReduce(*group, plan.q.data(), plan.q.size())->Wait();
  if (!status.ok()) return status;
  for (Matrix& m : plan.matrices) {
    MatrixMap M(grads + m.offset, m.rows, m.cols);
    MatrixMap P(plan.packed.data() + m.p_at, m.rows, m.rank);
    MatrixMap Q(plan.q.data() + m.q_at, m.cols, m.rank);
    if (!plan.error.empty()) {
      MatrixMap E(plan.error.data() + m.e_at, m.rows, m.cols);
      E = M;
      M.noalias() = P * Q.transpose();
      E -= M;
    } else {
      M.noalias() = P * Q.transpose();
    }
    m.q_ready = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<PowerSgdHook>> PowerSgdHook::Create(
    const PowerSgdOptions& options, std::vector<MatrixShape> param_shapes) {
  if (options.matrix_approximation_rank < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PowerSGD: matrix_approximation_rank is ",
        options.matrix_approximation_rank, "; it must be at least 1"));
  }
  if (options.start_powersgd_iter < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PowerSGD: start_powersgd_iter is ",
                     options.start_powersgd_iter, "; it must be >= 0"));
  }
  if (!(options.min_compression_rate >= 0) ||
      !(options.orthogonalization_epsilon >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PowerSGD: min_compression_rate (", options.min_compression_rate,
        ") and orthogonalization_epsilon (", options.orthogonalization_epsilon,
        ") must be >= 0"));
  }
  if (param_shapes.empty() ||
      param_shapes.size() >
          static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("PowerSGD: ", param_shapes.size(),
                     " parameter shapes; pass one per Reducer parameter"));
  }
  auto state = std::make_unique<State>();
  state->options = options;
  for (size_t p = 0; p < param_shapes.size(); ++p) {
    const MatrixShape& s = param_shapes[p];
    if (s.rows == 0 || s.cols == 0 ||
        s.rows > std::numeric_limits<size_t>::max() / sizeof(float) / s.cols) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PowerSGD: parameter ", p, " has shape ", s.rows, " x ", s.cols,
          "; both dimensions must be positive and the "
          "bytes addressable"));
    }
    const size_t rank =
        std::min({static_cast<size_t>(options.matrix_approximation_rank),
                  s.rows, s.cols});
    // In double: rows x cols may exceed a float's exact range.
    const bool compress =
        s.cols > 1 && static_cast<double>(s.rows) * s.cols >=
                          options.min_compression_rate *
                              static_cast<double>(s.rows + s.cols) * rank;
    state->ranks.push_back(compress ? rank : 0);
  }
  state->shapes = std::move(param_shapes);
  return std::shared_ptr<PowerSgdHook>(new PowerSgdHook(std::move(state)));
}

PowerSgdHook::PowerSgdHook(std::unique_ptr<State> state)
    : state_(std::move(state)) {}

PowerSgdHook::~PowerSgdHook() = default;

std::string PowerSgdHook::name() const {
  return absl::StrCat("powersgd_r", state_->options.matrix_approximation_rank);
}

absl::Status PowerSgdHook::OnLayout(absl::Span<const ReducerBucket> buckets) {
  State& s = *state_;
  if (absl::Status status = s.CheckLayout(buckets); !status.ok()) {
    return status;
  }
  std::vector<BucketPlan> old_plans = std::move(s.plans);
  std::vector<std::pair<int, int>> old_where = std::move(s.where);
  s.plans.clear();
  s.where.assign(s.shapes.size(), {-1, -1});
  for (size_t b = 0; b < buckets.size(); ++b) {
    s.plans.push_back(s.Plan(buckets[b]));
    const std::vector<Matrix>& matrices = s.plans.back().matrices;
    for (size_t i = 0; i < matrices.size(); ++i) {
      s.where[matrices[i].param] = {static_cast<int>(b), static_cast<int>(i)};
    }
  }
  if (!old_where.empty()) s.CarryOver(old_plans, old_where);
  return absl::OkStatus();
}

std::shared_ptr<Work> PowerSgdHook::Launch(ProcessGroup& group, int bucket,
                                           BufferView grads) {
  State& s = *state_;
  if (group.device_memory() != nullptr) {
    return Work::Done(absl::UnimplementedError(
        "PowerSGD runs on host groups only (Gloo): this group's buffers are "
        "device memory (NCCL); use AllReduceHook, Fp16CompressHook or "
        "Bf16CompressHook there"));
  }
  if (absl::Status status = s.CheckBucket(bucket, grads, "Launch");
      !status.ok()) {
    return Work::Done(status);
  }
  if (bucket == 0) {
    s.iteration = s.iterations++;
    s.compressing = s.iteration >= s.options.start_powersgd_iter;
  }
  s.group = &group;
  BucketPlan& plan = s.plans[bucket];
  float* data = static_cast<float*>(grads.data);
  if (!s.compressing || plan.matrices.empty()) {
    plan.launched = Launched::kPlain;
    return s.AllReduce(group, data, grads.count);
  }
  plan.launched = Launched::kCompressed;
  s.Compress(plan, data);
  return s.AllReduce(group, plan.packed.data(), plan.packed.size());
}

absl::Status PowerSgdHook::Finalize(int bucket, BufferView grads) {
  State& s = *state_;
  if (absl::Status status = s.CheckBucket(bucket, grads, "Finalize");
      !status.ok()) {
    return status;
  }
  BucketPlan& plan = s.plans[bucket];
  const Launched launched = plan.launched;
  plan.launched = Launched::kNone;
  switch (launched) {
    case Launched::kNone:
      return absl::FailedPreconditionError(
          absl::StrCat("PowerSGD: Finalize for bucket ", bucket,
                       " without a matching Launch"));
    case Launched::kPlain:
      return absl::OkStatus();
    case Launched::kCompressed:
      break;
  }
  return s.Decompress(plan, static_cast<float*>(grads.data));
}

std::optional<uint64_t> PowerSgdHook::bytes_sent() const {
  return state_->bytes_sent;
}

size_t PowerSgdHook::scratch_bytes() const {
  size_t floats = 0;
  for (const BucketPlan& plan : state_->plans) {
    floats += plan.packed.size() + plan.q.size() + plan.error.size();
  }
  return floats * sizeof(float);
}

bool PowerSgdHook::compressed(int param) const {
  return param >= 0 && static_cast<size_t>(param) < state_->ranks.size() &&
         state_->ranks[param] > 0;
}

absl::Span<const float> PowerSgdHook::error(int param) const {
  const State& s = *state_;
  if (param < 0 || static_cast<size_t>(param) >= s.where.size()) return {};
  const auto [b, i] = s.where[param];
  if (b < 0 || s.plans[b].error.empty()) return {};
  const Matrix& m = s.plans[b].matrices[i];
  return absl::Span<const float>(s.plans[b].error.data() + m.e_at,
                                 m.rows * m.cols);
}

int64_t PowerSgdHook::iterations() const { return state_->iterations; }

}  // namespace cohort

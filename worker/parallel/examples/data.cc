#include "worker/parallel/examples/data.h"

#include <cmath>
#include <random>
#include <utility>

namespace cohort::examples {
namespace {

// Standard normal by Box-Muller from 53-bit uniforms: reproducible across
// standard libraries, unlike std::normal_distribution.
double Uniform01(std::mt19937_64& rng) {
  return (static_cast<double>(rng() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

float Normal(std::mt19937_64& rng) {
  const double u1 = Uniform01(rng);
  const double u2 = Uniform01(rng);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) *
                            std::cos(2.0 * M_PI * u2));
}

}  // namespace

Dataset MakeTeacherDataset(size_t samples, const std::vector<int>& teacher_dims,
                           uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 1);
  Dataset data;
  data.inputs.resize(teacher_dims.front(), static_cast<Eigen::Index>(samples));
  for (Eigen::Index j = 0; j < data.inputs.cols(); ++j) {
    for (Eigen::Index i = 0; i < data.inputs.rows(); ++i) {
      data.inputs(i, j) = Normal(rng);
    }
  }
  const Mlp teacher(teacher_dims);
  data.targets = teacher.Predict(data.inputs, teacher.Init(seed + 1000003));
  return data;
}

DistributedSampler::DistributedSampler(size_t dataset_size, int replicas,
                                       int rank, uint64_t seed)
    : dataset_size_(dataset_size),
      replicas_(replicas),
      rank_(rank),
      seed_(seed) {}

std::vector<size_t> DistributedSampler::Indices(int epoch) const {
  std::vector<size_t> order(dataset_size_);
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  // Fisher-Yates with a bounded draw of our own, so every rank (and every
  // build) shuffles identically.
  std::mt19937_64 rng(seed_ + static_cast<uint64_t>(epoch));
  for (size_t i = order.size(); i > 1; --i) {
    std::swap(order[i - 1], order[rng() % i]);
  }
  const size_t per_rank = (dataset_size_ + replicas_ - 1) / replicas_;
  std::vector<size_t> mine;
  mine.reserve(per_rank);
  for (size_t j = 0; j < per_rank; ++j) {
    mine.push_back(order[(rank_ + j * replicas_) % dataset_size_]);
  }
  return mine;
}

Matrix Columns(const Matrix& m, const std::vector<size_t>& indices,
               size_t begin, size_t count) {
  Matrix out(m.rows(), static_cast<Eigen::Index>(count));
  for (size_t j = 0; j < count; ++j) {
    out.col(static_cast<Eigen::Index>(j)) =
        m.col(static_cast<Eigen::Index>(indices[begin + j]));
  }
  return out;
}

}  // namespace cohort::examples

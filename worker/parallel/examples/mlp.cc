#include "worker/parallel/examples/mlp.h"

#include <cmath>
#include <random>
#include <utility>

extern "C" void openblas_set_num_threads(int threads);

namespace cohort::examples {
namespace {

using ConstMap = Eigen::Map<const Matrix>;
using Map = Eigen::Map<Matrix>;
using ConstVectorMap = Eigen::Map<const Eigen::VectorXf>;
using VectorMap = Eigen::Map<Eigen::VectorXf>;

// A uniform float in [-bound, bound) from the top 24 bits of one draw: the
// same sequence on every platform, unlike std::uniform_real_distribution.
float Uniform(std::mt19937_64& rng, float bound) {
  const float unit = static_cast<float>(rng() >> 40) * (1.0f / (1 << 24));
  return (2.0f * unit - 1.0f) * bound;
}

}  // namespace

void SetComputeThreads(int threads) { openblas_set_num_threads(threads); }

Mlp::Mlp(std::vector<int> dims) : dims_(std::move(dims)) {
  activations_.resize(dims_.size());
}

size_t Mlp::weight_size(int layer) const {
  return static_cast<size_t>(dims_[layer]) * dims_[layer + 1];
}

size_t Mlp::bias_size(int layer) const { return dims_[layer + 1]; }

std::vector<size_t> Mlp::ParamSizes() const {
  std::vector<size_t> sizes;
  for (int l = 0; l < num_layers(); ++l) {
    sizes.push_back(weight_size(l));
    sizes.push_back(bias_size(l));
  }
  return sizes;
}

std::vector<std::vector<float>> Mlp::Init(uint64_t seed) const {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<float>> params;
  for (int l = 0; l < num_layers(); ++l) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(dims_[l]));
    for (size_t size : {weight_size(l), bias_size(l)}) {
      std::vector<float> values(size);
      for (float& v : values) v = Uniform(rng, bound);
      params.push_back(std::move(values));
    }
  }
  return params;
}

namespace {

void RoundMatrix(Precision precision, Matrix& m) {
  RoundInPlace(precision, absl::MakeSpan(m.data(), m.size()));
}

}  // namespace

void Mlp::Begin(const Matrix& inputs) {
  activations_[0] = inputs;
  RoundMatrix(precision_, activations_[0]);
}

void Mlp::Forward(int layer, LayerParams params) {
  const ConstMap w(params.weight, dims_[layer + 1], dims_[layer]);
  const ConstVectorMap b(params.bias, dims_[layer + 1]);
  Matrix& out = activations_[layer + 1];
  out.noalias() = w * activations_[layer];
  out.colwise() += b;
  if (layer + 1 < num_layers()) out = out.cwiseMax(0.0f);
  RoundMatrix(precision_, out);
}

float Mlp::Loss(const Matrix& targets, float grad_scale) {
  const Matrix& outputs = activations_.back();
  const float batch = static_cast<float>(outputs.cols());
  delta_ = outputs - targets;
  const float loss = 0.5f * delta_.squaredNorm() / batch;
  delta_ *= grad_scale / batch;
  RoundMatrix(precision_, delta_);
  return loss;
}

void Mlp::Backward(int layer, LayerParams params, LayerGrads grads) {
  Map dw(grads.weight, dims_[layer + 1], dims_[layer]);
  VectorMap db(grads.bias, dims_[layer + 1]);
  dw.noalias() += delta_ * activations_[layer].transpose();
  db += delta_.rowwise().sum();
  if (layer == 0) return;
  const ConstMap w(params.weight, dims_[layer + 1], dims_[layer]);
  Matrix upstream = w.transpose() * delta_;
  // activations_[layer] is relu(z): its gradient passes where it is > 0.
  delta_ =
      (activations_[layer].array() > 0.0f)
          .select(upstream, Matrix::Zero(upstream.rows(), upstream.cols()));
  RoundMatrix(precision_, delta_);
}

Matrix Mlp::Predict(const Matrix& inputs,
                    const std::vector<std::vector<float>>& params) const {
  Matrix current = inputs;
  for (int l = 0; l < num_layers(); ++l) {
    const ConstMap w(params[2 * l].data(), dims_[l + 1], dims_[l]);
    const ConstVectorMap b(params[2 * l + 1].data(), dims_[l + 1]);
    Matrix next = w * current;
    next.colwise() += b;
    if (l + 1 < num_layers()) next = next.cwiseMax(0.0f);
    current = std::move(next);
  }
  return current;
}

}  // namespace cohort::examples

// A multilayer perceptron (ReLU hidden layers, linear output, mean squared
// error) whose math is Eigen's (its matrix products OpenBLAS's), over
// parameters the caller owns: the same
// layer code runs on a DDP replica's own buffers and on the full parameters
// FSDP gathers for one unit at a time, so it takes pointers, not tensors.
//
// Layer l maps dims[l] inputs to dims[l+1] outputs with a weight (dims[l+1]
// x dims[l], column-major) and a bias (dims[l+1]). Batches are matrices
// with one sample per column.
#ifndef COHORT_WORKER_PARALLEL_EXAMPLES_MLP_H_
#define COHORT_WORKER_PARALLEL_EXAMPLES_MLP_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "Eigen/Core"
#include "worker/parallel/mixed_precision.h"

namespace cohort::examples {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic>;

// The threads each matrix product may use (OpenBLAS's pool). Several ranks
// per machine each want 1, as torchrun's OMP_NUM_THREADS=1.
void SetComputeThreads(int threads);

class Mlp {
 public:
  struct LayerParams {
    const float* weight;
    const float* bias;
  };
  struct LayerGrads {
    float* weight;
    float* bias;
  };

  // REQUIRES: at least two dims, all positive.
  explicit Mlp(std::vector<int> dims);

  // The compute precision (mixed_precision.h): the batch, every layer's
  // output and every gradient flowing backward are rounded to it, the
  // products accumulate in f32. The caller rounds the parameters it passes
  // (and the gradients it gets). f32 (the default) rounds nothing.
  void set_precision(Precision precision) { precision_ = precision; }
  Precision precision() const { return precision_; }

  int num_layers() const { return static_cast<int>(dims_.size()) - 1; }
  const std::vector<int>& dims() const { return dims_; }
  size_t weight_size(int layer) const;
  size_t bias_size(int layer) const;
  // Every parameter's element count, layer by layer: weight, then bias.
  std::vector<size_t> ParamSizes() const;

  // Parameters as torch.nn.Linear initialises them (uniform in
  // +-1/sqrt(fan_in)), from `seed` alone: equal on every rank.
  std::vector<std::vector<float>> Init(uint64_t seed) const;

  // One training step's passes, in this order: Begin, Forward for layers
  // 0..L-1, Loss, Backward for layers L-1..0. Forward and Backward of a
  // layer must see the same parameters.
  void Begin(const Matrix& inputs);
  void Forward(int layer, LayerParams params);
  // The mean over the batch of half the squared error against `targets`
  // (one column per sample). Seeds the backward pass with its gradient
  // times `grad_scale` (1 / micro-batches when accumulating).
  float Loss(const Matrix& targets, float grad_scale = 1.0f);
  // Adds this batch's gradients of layer `layer` into `grads`.
  void Backward(int layer, LayerParams params, LayerGrads grads);

  // The network's outputs for `inputs` (no state kept for backward).
  Matrix Predict(const Matrix& inputs,
                 const std::vector<std::vector<float>>& params) const;

 private:
  std::vector<int> dims_;
  Precision precision_ = Precision::kF32;
  // activations_[l]: the input of layer l (activations_[0] is the batch);
  // activations_[L]: the output.
  std::vector<Matrix> activations_;
  Matrix delta_;  // d loss / d (output of the layer being back-propagated).
};

}  // namespace cohort::examples

#endif  // COHORT_WORKER_PARALLEL_EXAMPLES_MLP_H_

// The training example's data: a synthetic regression task that a network
// can learn (the targets come from a fixed random "teacher" network), and
// a sampler that splits it across ranks as torch's DistributedSampler does.
#ifndef COHORT_WORKER_PARALLEL_EXAMPLES_DATA_H_
#define COHORT_WORKER_PARALLEL_EXAMPLES_DATA_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "worker/parallel/examples/mlp.h"

namespace cohort::examples {

struct Dataset {
  Matrix inputs;   // One sample per column.
  Matrix targets;  // The teacher's output for each column of inputs.
  size_t size() const { return static_cast<size_t>(inputs.cols()); }
};

// `samples` standard-normal inputs of teacher_dims.front() features and the
// outputs of an Mlp(teacher_dims) initialised from `seed`: the same data on
// every rank for the same arguments.
Dataset MakeTeacherDataset(size_t samples, const std::vector<int>& teacher_dims,
                           uint64_t seed);

// torch.utils.data.DistributedSampler with shuffle=True: every epoch a
// permutation of the dataset drawn from (seed + epoch), padded by wrapping
// to a multiple of `replicas`, of which rank r takes positions r,
// r + replicas, r + 2 * replicas ... So batch k of b samples on each of N
// ranks covers positions [k*b*N, (k+1)*b*N) of the permutation: the global
// batch does not depend on N.
class DistributedSampler {
 public:
  DistributedSampler(size_t dataset_size, int replicas, int rank,
                     uint64_t seed);

  std::vector<size_t> Indices(int epoch) const;

 private:
  size_t dataset_size_;
  int replicas_;
  int rank_;
  uint64_t seed_;
};

// The columns `indices` of `m`.
Matrix Columns(const Matrix& m, const std::vector<size_t>& indices,
               size_t begin, size_t count);

}  // namespace cohort::examples

#endif  // COHORT_WORKER_PARALLEL_EXAMPLES_DATA_H_

// PowerSGD (Vogels, Karimireddy and Jaggi, 2019) as a DDP communication
// hook, with the semantics of torch's ddp_comm_hooks/powerSGD_hook.py: each
// gradient matrix M (rows x cols) is sent as two thin factors instead of
// itself, P = M Q (rows x r) and Q = M^T P (cols x r), one power-iteration
// step per training iteration, so a bucket's traffic drops from
// rows x cols to (rows + cols) x r floats per matrix.
//
//   auto hook = cohort::PowerSgdHook::Create(options, shapes).value();
//   reducer_options.hook = hook;
//   auto reducer = cohort::Reducer::Create(group, sizes, reducer_options);
//
// Per bucket, in a synchronized iteration from start_powersgd_iter on:
//  Launch: for each compressed matrix, M += e (its error-feedback residual),
//    Q (kept from the last iteration with warm_start, else drawn afresh) is
//    orthonormalized and P = M Q; the uncompressed parameters and every P
//    are packed into one f32 scratch buffer, all_reduced (AVG): the Work
//    returned.
//  Finalize: the uncompressed averages go back into the bucket; each P's
//    columns are orthonormalized (Gram-Schmidt), Q = M^T P, every Q of the
//    bucket is all_reduced (AVG) in one op and waited for here; the bucket
//    gets M_approx = P Q^T, the projection of the ranks' average onto P's
//    columns, and e = M - M_approx (M: this rank's, with e) is kept.
// Before start_powersgd_iter a bucket is all_reduced (AVG) whole, exactly
// as AllReduceHook() does. Error feedback starts at zero when compression
// starts; with it, the gradients applied over the compressed iterations
// sum to this rank's own gradients over them less its current residual:
// what the compression held back is applied later.
//
// Which tensors are compressed. Parameter i is a column-major matrix
// param_shapes[i] (a bias: rows x 1). With r' = min(r, rows, cols), it is
// compressed if cols > 1 and rows x cols >= min_compression_rate x
// (rows + cols) x r'; the rest (biases, small matrices) are averaged
// exactly, as AllReduceHook() would. (torch compresses only when the ratio
// is strictly greater.)
//
// Differences from torch, each for robustness: the error residual covers
// the compressed matrices only (torch's covers the whole bucket, so an
// uncompressed tensor's "error" is its local value minus the average);
// Gram-Schmidt projects each column twice (with rank r above a gradient's
// rank, P's spare columns are rounding noise that one pass leaves far from
// orthogonal to the others); a warm-start Q with a column that vanished
// (a gradient that was zero) is drawn afresh instead of staying zero; and
// the state is kept per parameter, so the first-iteration rebuild may
// change the buckets under a warm start or error feedback, and
// start_powersgd_iter may be 0.
//
// Iterations are counted at each Launch of bucket 0 (one per synchronized
// iteration; no_sync iterations do not count), the same on every rank.
//
// Host memory only: on a group with device_memory() (NCCL) every Launch
// returns UNIMPLEMENTED. Every rank must compute the same P and Q from the
// same all-reduced inputs, so the ranks must run the same binary on the
// same kind of CPU: then the arithmetic after each all_reduce is the same
// sequence of f32 operations everywhere.
#ifndef COHORT_WORKER_PARALLEL_POWERSGD_H_
#define COHORT_WORKER_PARALLEL_POWERSGD_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/collective/process_group.h"
#include "worker/parallel/ddp.h"

namespace cohort {

// A parameter's gradient as a column-major rows x cols matrix (element
// (i, j) at i + j x rows). A vector (a bias) is rows x 1.
struct MatrixShape {
  size_t rows = 0;
  size_t cols = 0;
};

struct PowerSgdOptions {
  // r: the columns of P and Q. Must be >= 1.
  int matrix_approximation_rank = 1;
  // Synchronized iterations reduced by plain all_reduce (AVG) first: the
  // first gradients are large and worth sending whole. Must be >= 0.
  int start_powersgd_iter = 10;
  // A matrix is compressed only if it shrinks at least this much (see
  // above). Must be >= 0.
  double min_compression_rate = 2.0;
  // Carry each matrix's compression error into its next gradient.
  bool use_error_feedback = true;
  // Keep Q from one iteration to the next (one more power-iteration step
  // on a slowly changing gradient); false draws Q afresh each iteration.
  bool warm_start = true;
  // Q's random values (PowerSgdInitialQ): the same on every rank.
  uint64_t seed = 0;
  // Gram-Schmidt divides each column by its norm plus this (torch's
  // orthogonalization_epsilon); a column whose norm plus this is 0 becomes
  // zero instead. Must be >= 0.
  float orthogonalization_epsilon = 0;
};

class PowerSgdHook : public CommHook {
 public:
  // `param_shapes[i]` is parameter i's shape, for the Reducer's parameter i
  // (its element count must be rows x cols; OnLayout checks).
  // INVALID_ARGUMENT naming the option or parameter for a rank < 1, a
  // negative start_powersgd_iter, min_compression_rate or epsilon (or NaN),
  // no shapes, or a shape with a zero dimension or too many elements.
  static absl::StatusOr<std::shared_ptr<PowerSgdHook>> Create(
      const PowerSgdOptions& options, std::vector<MatrixShape> param_shapes);

  ~PowerSgdHook() override;

  // "powersgd_r<rank>", e.g. "powersgd_r1".
  std::string name() const override;

  // INVALID_ARGUMENT if the buckets do not hold exactly the parameters
  // 0 .. param_shapes.size()-1, or hold one with other than rows x cols
  // elements. Carries each parameter's Q and residual over to the new
  // layout.
  absl::Status OnLayout(absl::Span<const ReducerBucket> buckets) override;

  // See above. The Work fails (before anything is sent) with UNIMPLEMENTED
  // on a device-memory group, FAILED_PRECONDITION for a bucket the last
  // OnLayout did not announce or of another size, INVALID_ARGUMENT for a
  // buffer that is not f32.
  std::shared_ptr<Work> Launch(ProcessGroup& group, int bucket,
                               BufferView grads) override;

  // Blocks on the Q all_reduce of a compressed bucket and returns its
  // error. FAILED_PRECONDITION without a matching Launch.
  absl::Status Finalize(int bucket, BufferView grads) override;

  // WireBytes(kAllReduce, ...) of every all_reduce issued: the whole f32
  // bucket before start_powersgd_iter; after it, the uncompressed elements
  // plus the P's, then the Q's.
  std::optional<uint64_t> bytes_sent() const override;

  // The packed uncompressed elements and P's, the Q's and the residuals,
  // held from OnLayout on.
  size_t scratch_bytes() const override;

  // Whether parameter `param` is compressed (by the rule above); false for
  // an index out of range.
  bool compressed(int param) const;
  // Parameter `param`'s error-feedback residual (rows x cols, column-major),
  // zero until compression starts; empty when not compressed, without
  // error feedback or before OnLayout. Valid until the next OnLayout.
  absl::Span<const float> error(int param) const;
  // Synchronized iterations begun (Launches of bucket 0).
  int64_t iterations() const;

 private:
  struct State;
  explicit PowerSgdHook(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Fills `q` (a cols x r matrix, column-major) with the hook's random
// values for parameter `param` in iteration `iteration`: SplitMix64 of the
// three seeds, then a 64-bit Mersenne Twister, each value the sum of four
// uniforms on [0, 1) less 2 (a bell-shaped variate on (-2, 2) with only
// exactly rounded arithmetic, so that every rank and platform draws the
// same floats, which std::normal_distribution does not promise). The hook
// draws once per parameter with warm_start (in the first compressed
// iteration, and again if Q's columns vanish), else in every iteration.
void PowerSgdInitialQ(uint64_t seed, int param, int64_t iteration,
                      absl::Span<float> q);

}  // namespace cohort

#endif  // COHORT_WORKER_PARALLEL_POWERSGD_H_

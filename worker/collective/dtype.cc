#include "worker/collective/dtype.h"

namespace cohort {

size_t DtypeSize(Dtype dtype) {
  switch (dtype) {
    case Dtype::kI8:
    case Dtype::kU8:
      return 1;
    case Dtype::kF16:
    case Dtype::kBF16:
      return 2;
    case Dtype::kF32:
    case Dtype::kI32:
      return 4;
    case Dtype::kF64:
    case Dtype::kI64:
      return 8;
  }
  return 0;
}

absl::string_view DtypeName(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32:
      return "f32";
    case Dtype::kF64:
      return "f64";
    case Dtype::kF16:
      return "f16";
    case Dtype::kBF16:
      return "bf16";
    case Dtype::kI8:
      return "i8";
    case Dtype::kU8:
      return "u8";
    case Dtype::kI32:
      return "i32";
    case Dtype::kI64:
      return "i64";
  }
  return "unknown dtype";
}

absl::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "SUM";
    case ReduceOp::kProd:
      return "PROD";
    case ReduceOp::kMin:
      return "MIN";
    case ReduceOp::kMax:
      return "MAX";
    case ReduceOp::kAvg:
      return "AVG";
  }
  return "unknown op";
}

}  // namespace cohort

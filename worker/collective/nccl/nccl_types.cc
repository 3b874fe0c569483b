#include "worker/collective/nccl/nccl_types.h"

#include "absl/strings/str_cat.h"

namespace cohort {

absl::StatusOr<ncclDataType_t> ToNcclDataType(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32:
      return ncclFloat32;
    case Dtype::kF64:
      return ncclFloat64;
    case Dtype::kF16:
      return ncclFloat16;
    case Dtype::kBF16:
      return ncclBfloat16;
    case Dtype::kI8:
      return ncclInt8;
    case Dtype::kU8:
      return ncclUint8;
    case Dtype::kI32:
      return ncclInt32;
    case Dtype::kI64:
      return ncclInt64;
  }
  return absl::InvalidArgumentError(absl::StrCat("NCCL has no type for dtype ",
                                                 DtypeName(dtype), " (",
                                                 static_cast<int>(dtype), ")"));
}

absl::StatusOr<ncclRedOp_t> ToNcclRedOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kProd:
      return ncclProd;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kAvg:
      return ncclAvg;
  }
  return absl::InvalidArgumentError(absl::StrCat("NCCL has no reduce op for ",
                                                 ReduceOpName(op), " (",
                                                 static_cast<int>(op), ")"));
}

absl::Status FromNcclResult(ncclResult_t result, absl::string_view what,
                            ncclComm_t comm) {
  if (result == ncclSuccess || result == ncclInProgress) {
    return absl::OkStatus();
  }
  std::string message = absl::StrCat(what, ": ", ncclGetErrorString(result));
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') absl::StrAppend(&message, ": ", last);
  }
  if (result == ncclRemoteError || result == ncclSystemError) {
    return absl::UnavailableError(message);
  }
  return absl::InternalError(message);
}

}  // namespace cohort

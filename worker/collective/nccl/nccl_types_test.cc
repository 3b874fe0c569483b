// The mapping of cohort's dtypes and reduce ops onto NCCL's, and of NCCL's
// results onto status codes. Needs nccl.h, not a GPU.
#include "worker/collective/nccl/nccl_types.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

using ::testing::HasSubstr;

TEST(ToNcclDataType, EveryDtype) {
  EXPECT_EQ(*ToNcclDataType(Dtype::kF32), ncclFloat32);
  EXPECT_EQ(*ToNcclDataType(Dtype::kF64), ncclFloat64);
  EXPECT_EQ(*ToNcclDataType(Dtype::kF16), ncclFloat16);
  EXPECT_EQ(*ToNcclDataType(Dtype::kBF16), ncclBfloat16);
  EXPECT_EQ(*ToNcclDataType(Dtype::kI8), ncclInt8);
  EXPECT_EQ(*ToNcclDataType(Dtype::kU8), ncclUint8);
  EXPECT_EQ(*ToNcclDataType(Dtype::kI32), ncclInt32);
  EXPECT_EQ(*ToNcclDataType(Dtype::kI64), ncclInt64);
}

TEST(ToNcclDataType, RefusesAnUnknownDtypeNamingIt) {
  absl::StatusOr<ncclDataType_t> type = ToNcclDataType(static_cast<Dtype>(42));
  EXPECT_EQ(type.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(type.status().message(), HasSubstr("no type for dtype"));
  EXPECT_THAT(type.status().message(), HasSubstr("(42)"));
}

TEST(ToNcclRedOp, EveryOpAvgIsNcclsOwn) {
  EXPECT_EQ(*ToNcclRedOp(ReduceOp::kSum), ncclSum);
  EXPECT_EQ(*ToNcclRedOp(ReduceOp::kProd), ncclProd);
  EXPECT_EQ(*ToNcclRedOp(ReduceOp::kMin), ncclMin);
  EXPECT_EQ(*ToNcclRedOp(ReduceOp::kMax), ncclMax);
  EXPECT_EQ(*ToNcclRedOp(ReduceOp::kAvg), ncclAvg);
  EXPECT_EQ(ToNcclRedOp(static_cast<ReduceOp>(9)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FromNcclResult, CodesAPeerCanActOn) {
  EXPECT_TRUE(FromNcclResult(ncclSuccess, "x").ok());
  EXPECT_TRUE(FromNcclResult(ncclInProgress, "x").ok());
  absl::Status remote = FromNcclResult(ncclRemoteError, "ncclAllReduce");
  EXPECT_EQ(remote.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(remote.message(), HasSubstr("ncclAllReduce: "));
  EXPECT_EQ(FromNcclResult(ncclSystemError, "x").code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(FromNcclResult(ncclInvalidUsage, "x").code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(FromNcclResult(ncclUnhandledCudaError, "x").code(),
            absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace cohort

// absl::Status <-> grpc::Status. The codes are the same numbers by design
// (both follow google.rpc.Code), so conversion keeps code and message.
#ifndef COHORT_PROTO_RPC_GRPC_STATUS_H_
#define COHORT_PROTO_RPC_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace cohort::base {

grpc::Status ToGrpcStatus(const absl::Status& status);

// `context`, when not empty, is put before the message: "context: message".
absl::Status FromGrpcStatus(const grpc::Status& status,
                            absl::string_view context = "");

}  // namespace cohort::base

#endif  // COHORT_PROTO_RPC_GRPC_STATUS_H_

// InfoClient: cohort.v1.Info (proto/cohort/v1/info.proto) for cohortctl
// and cohortrun: what the cohortd at the address is, and where its TCPStore
// listener is. GetServerInfo is safe to repeat, so it is retried while
// cohortd is unavailable.
#ifndef COHORT_CLIENT_INFO_CLIENT_H_
#define COHORT_CLIENT_INFO_CLIENT_H_

#include <memory>

#include "absl/status/statusor.h"
#include "client/connection.h"
#include "cohort/v1/info.grpc.pb.h"

namespace cohort {

class InfoClient {
 public:
  static absl::StatusOr<std::unique_ptr<InfoClient>> Connect(
      const ConnectionOptions& options);
  explicit InfoClient(std::shared_ptr<Connection> connection);

  // UNIMPLEMENTED from a cohortd older than the Info service.
  absl::StatusOr<v1::ServerInfo> GetServerInfo();

 private:
  std::shared_ptr<Connection> connection_;
  std::unique_ptr<v1::Info::Stub> stub_;
};

}  // namespace cohort

#endif  // COHORT_CLIENT_INFO_CLIENT_H_

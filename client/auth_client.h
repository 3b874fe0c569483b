// AuthClient: cohort.v1.Auth (proto/cohort/v1/auth.proto) for cohortctl
// and cohortrun: who the token is, and issuing, revoking and listing
// tokens. Calls are not retried, except WhoAmI and ListTokens, which are
// safe to repeat.
#ifndef COHORT_CLIENT_AUTH_CLIENT_H_
#define COHORT_CLIENT_AUTH_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "cohort/v1/auth.grpc.pb.h"

namespace cohort {

class AuthClient {
 public:
  static absl::StatusOr<std::unique_ptr<AuthClient>> Connect(
      const ConnectionOptions& options);
  explicit AuthClient(std::shared_ptr<Connection> connection);

  absl::StatusOr<v1::WhoAmIResponse> WhoAmI();
  // `role` is "r", "rw" or "admin"; `ttl` zero: until revoked.
  absl::StatusOr<v1::IssueTokenResponse> Issue(absl::string_view role,
                                               absl::string_view prefix,
                                               absl::Duration ttl,
                                               absl::string_view description);
  absl::Status Revoke(absl::string_view id);
  absl::StatusOr<v1::ListTokensResponse> List();

 private:
  std::shared_ptr<Connection> connection_;
  std::unique_ptr<v1::Auth::Stub> stub_;
};

}  // namespace cohort

#endif  // COHORT_CLIENT_AUTH_CLIENT_H_

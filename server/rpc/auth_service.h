// AuthService: the gRPC glue of cohort.v1.Auth (auth.proto) over an
// Authenticator, which may be null: then every call is FAILED_PRECONDITION,
// cohortd running without --auth_tokens.
#ifndef COHORT_SERVER_RPC_AUTH_SERVICE_H_
#define COHORT_SERVER_RPC_AUTH_SERVICE_H_

#include "cohort/v1/auth.grpc.pb.h"
#include "server/auth/auth.h"

namespace cohort::server {

class AuthService final : public v1::Auth::CallbackService {
 public:
  explicit AuthService(Authenticator* auth) : auth_(auth) {}

  grpc::ServerUnaryReactor* WhoAmI(grpc::CallbackServerContext* ctx,
                                   const v1::WhoAmIRequest* req,
                                   v1::WhoAmIResponse* resp) override;
  grpc::ServerUnaryReactor* IssueToken(grpc::CallbackServerContext* ctx,
                                       const v1::IssueTokenRequest* req,
                                       v1::IssueTokenResponse* resp) override;
  grpc::ServerUnaryReactor* RevokeToken(grpc::CallbackServerContext* ctx,
                                        const v1::RevokeTokenRequest* req,
                                        v1::RevokeTokenResponse* resp) override;
  grpc::ServerUnaryReactor* ListTokens(grpc::CallbackServerContext* ctx,
                                       const v1::ListTokensRequest* req,
                                       v1::ListTokensResponse* resp) override;

 private:
  Authenticator* const auth_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_RPC_AUTH_SERVICE_H_

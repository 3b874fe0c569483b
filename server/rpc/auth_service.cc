#include "server/rpc/auth_service.h"

#include <utility>

#include "server/rpc/reactors.h"

namespace cohort::server {
namespace {

absl::Status AuthOff() {
  return absl::FailedPreconditionError(
      "cohortd runs without auth (no --auth_tokens): there are no tokens");
}

}  // namespace

grpc::ServerUnaryReactor* AuthService::WhoAmI(grpc::CallbackServerContext* ctx,
                                              const v1::WhoAmIRequest*,
                                              v1::WhoAmIResponse* resp) {
  if (auth_ == nullptr) return FinishNow(ctx, AuthOff());
  absl::StatusOr<Grant> grant = auth_->Authenticate(ctx->client_metadata());
  if (grant.ok()) {
    resp->set_role(grant->role);
    resp->set_prefix(grant->prefix);
    resp->set_source(grant->source);
    resp->set_expires_unix_ms(grant->expires_unix_ms);
  }
  return FinishNow(ctx, grant.status());
}

grpc::ServerUnaryReactor* AuthService::IssueToken(
    grpc::CallbackServerContext* ctx, const v1::IssueTokenRequest* req,
    v1::IssueTokenResponse* resp) {
  if (auth_ == nullptr) return FinishNow(ctx, AuthOff());
  absl::StatusOr<Grant> grant = auth_->Authenticate(ctx->client_metadata());
  if (!grant.ok()) return FinishNow(ctx, grant.status());
  absl::StatusOr<v1::IssueTokenResponse> issued = auth_->Issue(*grant, *req);
  if (issued.ok()) *resp = std::move(*issued);
  return FinishNow(ctx, issued.status());
}

grpc::ServerUnaryReactor* AuthService::RevokeToken(
    grpc::CallbackServerContext* ctx, const v1::RevokeTokenRequest* req,
    v1::RevokeTokenResponse*) {
  if (auth_ == nullptr) return FinishNow(ctx, AuthOff());
  absl::StatusOr<Grant> grant = auth_->Authenticate(ctx->client_metadata());
  if (!grant.ok()) return FinishNow(ctx, grant.status());
  return FinishNow(ctx, auth_->Revoke(*grant, req->id()));
}

grpc::ServerUnaryReactor* AuthService::ListTokens(
    grpc::CallbackServerContext* ctx, const v1::ListTokensRequest*,
    v1::ListTokensResponse* resp) {
  if (auth_ == nullptr) return FinishNow(ctx, AuthOff());
  absl::StatusOr<Grant> grant = auth_->Authenticate(ctx->client_metadata());
  if (!grant.ok()) return FinishNow(ctx, grant.status());
  absl::StatusOr<v1::ListTokensResponse> listed = auth_->List(*grant);
  if (listed.ok()) *resp = std::move(*listed);
  return FinishNow(ctx, listed.status());
}

}  // namespace cohort::server

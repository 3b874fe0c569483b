#include "client/auth_client.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/auth/roles.h"

namespace cohort {

absl::StatusOr<std::unique_ptr<AuthClient>> AuthClient::Connect(
    const ConnectionOptions& options) {
  absl::StatusOr<std::shared_ptr<Connection>> connection =
      Connection::Open(options);
  if (!connection.ok()) return connection.status();
  return std::make_unique<AuthClient>(std::move(*connection));
}

AuthClient::AuthClient(std::shared_ptr<Connection> connection)
    : connection_(std::move(connection)),
      stub_(v1::Auth::NewStub(connection_->channel())) {}

absl::StatusOr<v1::WhoAmIResponse> AuthClient::WhoAmI() {
  v1::WhoAmIRequest request;
  v1::WhoAmIResponse response;
  absl::Status s = connection_->Call(
      "whoami", CallOptions::Retryable(connection_->options().rpc_timeout),
      stub_.get(), &v1::Auth::Stub::WhoAmI, request, &response);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::IssueTokenResponse> AuthClient::Issue(
    absl::string_view role, absl::string_view prefix, absl::Duration ttl,
    absl::string_view description) {
  v1::IssueTokenRequest request;
  std::optional<v1::Role> parsed = auth::ParseRole(role);
  if (!parsed.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("role must be r, rw or admin, got '", role, "'"));
  }
  request.set_role(*parsed);
  if (ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the lifetime must be >= 0");
  }
  request.set_prefix(std::string(prefix));
  request.set_ttl_ms(absl::ToInt64Milliseconds(ttl));
  request.set_description(std::string(description));
  v1::IssueTokenResponse response;
  absl::Status s = connection_->Call(
      absl::StrCat("issuing a ", role, " token for '", prefix, "'"),
      CallOptions::Once(connection_->options().rpc_timeout), stub_.get(),
      &v1::Auth::Stub::IssueToken, request, &response);
  if (!s.ok()) return s;
  return response;
}

absl::Status AuthClient::Revoke(absl::string_view id) {
  v1::RevokeTokenRequest request;
  request.set_id(std::string(id));
  v1::RevokeTokenResponse response;
  // Revoking twice is harmless (the second finds nothing).
  return connection_->Call(
      "revoking a token",
      CallOptions::Retryable(connection_->options().rpc_timeout), stub_.get(),
      &v1::Auth::Stub::RevokeToken, request, &response);
}

absl::StatusOr<v1::ListTokensResponse> AuthClient::List() {
  v1::ListTokensRequest request;
  v1::ListTokensResponse response;
  absl::Status s = connection_->Call(
      "listing tokens",
      CallOptions::Retryable(connection_->options().rpc_timeout), stub_.get(),
      &v1::Auth::Stub::ListTokens, request, &response);
  if (!s.ok()) return s;
  return response;
}

}  // namespace cohort

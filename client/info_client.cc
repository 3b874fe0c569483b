#include "client/info_client.h"

#include <utility>

namespace cohort {

absl::StatusOr<std::unique_ptr<InfoClient>> InfoClient::Connect(
    const ConnectionOptions& options) {
  absl::StatusOr<std::shared_ptr<Connection>> connection =
      Connection::Open(options);
  if (!connection.ok()) return connection.status();
  return std::make_unique<InfoClient>(std::move(*connection));
}

InfoClient::InfoClient(std::shared_ptr<Connection> connection)
    : connection_(std::move(connection)),
      stub_(v1::Info::NewStub(connection_->channel())) {}

absl::StatusOr<v1::ServerInfo> InfoClient::GetServerInfo() {
  v1::ServerInfo info;
  absl::Status s = connection_->Call(
      "info",
      CallOptions::Retryable(connection_->options().rpc_timeout), stub_.get(),
      &v1::Info::Stub::GetServerInfo, v1::GetServerInfoRequest(), &info);
  if (!s.ok()) return s;
  return info;
}

}  // namespace cohort

#include "client/connection.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/grpc_status.h"
#include "grpcpp/create_channel.h"

namespace cohort {

absl::StatusOr<std::shared_ptr<Connection>> Connection::Open(
    const ConnectionOptions& options) {
  if (options.address.empty() ||
      options.address.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cohortd address must be HOST:PORT, got '", options.address, "'"));
  }
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError("max_attempts must be >= 1");
  }
  return std::shared_ptr<Connection>(new Connection(options));
}

Connection::Connection(const ConnectionOptions& options) : options_(options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // Each connection is a TCP connection of its own rather than one shared
  // with every other channel to the same address in the process.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Reconnect quickly after a cohortd restart.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // After a failed connection gRPC re-resolves the address, by default at
  // most every 30 s; a restarted cohortd must not wait on that.
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 500);
  channel_ = grpc::CreateCustomChannel(
      options.address, grpc::InsecureChannelCredentials(), args);
}

absl::Status Connection::WaitConnected() {
  if (channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) {
    return absl::OkStatus();
  }
  if (channel_->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options_.connect_timeout))) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(
      absl::StrCat("cannot connect to cohortd at ", options_.address,
                   " within ", absl::FormatDuration(options_.connect_timeout),
                   ": is it running there? (set --addr or COHORT_ADDR)"));
}

absl::Status Connection::Explain(absl::string_view what,
                                 const grpc::Status& status,
                                 int attempts) const {
  std::string message = status.error_message();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    message = absl::StrCat("cohortd at ", options_.address, " is unavailable (",
                           attempts, attempts == 1 ? " attempt" : " attempts",
                           "): ", message);
  } else if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
             message == "Deadline Exceeded") {
    message = absl::StrCat("no answer from cohortd at ", options_.address,
                           " before the call's deadline");
  }
  return base::FromGrpcStatus(
      grpc::Status(status.error_code(), std::move(message)), what);
}

absl::Duration Connection::Backoff(absl::Duration backoff) const {
  thread_local std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<double> jitter(0.5, 1.0);
  absl::SleepFor(backoff * jitter(rng));
  return std::min(backoff * 2, options_.max_backoff);
}

}  // namespace cohort

// RemoteStore: cohort::Store backed by a cohortd over gRPC.
//
// Blocking calls pass their timeout to the server (which answers
// DEADLINE_EXCEEDED naming the missing keys) and give the gRPC call a little
// longer, so the server's explanation arrives first. Calls wait up to
// connect_timeout for a (re)connection. Calls that are safe to repeat are
// retried with exponential backoff when the server is UNAVAILABLE; Add,
// Append and CompareSet are not, because the first attempt may have been
// applied. Watches resume from the last revision they delivered, and keep
// trying for connect_timeout when cohortd is away.
#ifndef COHORT_CLIENT_REMOTE_STORE_H_
#define COHORT_CLIENT_REMOTE_STORE_H_

#include <memory>
#include <string>

#include "client/connection.h"
#include "client/store.h"
#include "cohort/v1/store.grpc.pb.h"

namespace cohort {

// The connection settings (address, timeouts, retries); see connection.h.
using RemoteStoreOptions = ConnectionOptions;

class RemoteStore final : public Store {
 public:
  // Creates the channel; does not wait for cohortd to be up.
  static absl::StatusOr<std::unique_ptr<RemoteStore>> Connect(
      const RemoteStoreOptions& options);

  const std::string& address() const { return connection_->options().address; }

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  using Store::Get;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<std::string> CompareSet(absl::string_view key,
                                         absl::string_view expected,
                                         absl::string_view desired) override;
  using Store::Wait;
  absl::Status Wait(absl::Span<const std::string> keys,
                    absl::Duration timeout) override;
  absl::StatusOr<bool> Check(absl::Span<const std::string> keys) override;
  absl::StatusOr<bool> DeleteKey(absl::string_view key) override;
  absl::StatusOr<int64_t> NumKeys() override;
  using Store::MultiGet;
  absl::StatusOr<std::vector<std::string>> MultiGet(
      absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::Status MultiSet(absl::Span<const std::string> keys,
                        absl::Span<const std::string> values) override;
  absl::Status Append(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<KeyList> ListKeys(absl::string_view prefix) override;
  absl::StatusOr<std::unique_ptr<WatchHandle>> Watch(
      absl::string_view prefix, int64_t from_revision,
      WatchCallback callback) override;

 private:
  class RemoteWatch;

  explicit RemoteStore(std::shared_ptr<Connection> connection);

  // A call safe to repeat (a read), retried while cohortd is unavailable;
  // one that is not (every write). A write whose answer was lost may have
  // applied: even a Set repeated after another client's write of the key
  // would bring its old value back, which the linearizability campaign
  // (tests/robustness/linearizability_test.sh) caught.
  CallOptions Repeatable() const {
    return CallOptions::Retryable(connection_->options().rpc_timeout);
  }
  CallOptions NotRepeatable() const {
    return CallOptions::Once(connection_->options().rpc_timeout);
  }
  // A read that blocks on the server up to `timeout`: its deadline leaves
  // the server time to answer with its own, better, timeout message.
  CallOptions Blocking(absl::Duration timeout) const {
    return CallOptions::Retryable(timeout + kServerTimeoutSlack);
  }

  template <typename Request, typename Response>
  absl::Status Call(absl::string_view what, const CallOptions& call,
                    grpc::Status (v1::Store::Stub::*method)(
                        grpc::ClientContext*, const Request&, Response*),
                    const Request& request, Response* response) {
    return connection_->Call(what, call, stub_.get(), method, request,
                             response);
  }

  std::shared_ptr<Connection> connection_;
  std::unique_ptr<v1::Store::Stub> stub_;
};

}  // namespace cohort

#endif  // COHORT_CLIENT_REMOTE_STORE_H_

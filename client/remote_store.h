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

#include "client/store.h"
#include "cohort/v1/store.grpc.pb.h"

namespace cohort {

// Where cohortctl and workers look for cohortd when told nothing else.
inline constexpr char kDefaultAddress[] = "localhost:29500";

struct RemoteStoreOptions {
  // HOST:PORT of cohortd.
  std::string address = kDefaultAddress;
  // How long a call waits for a connection to cohortd.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Deadline of calls that do not block on keys.
  absl::Duration rpc_timeout = absl::Seconds(30);
  // Attempts for a retryable call, the first included.
  int max_attempts = 5;
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
};

class RemoteStore final : public Store {
 public:
  // Creates the channel; does not wait for cohortd to be up.
  static absl::StatusOr<std::unique_ptr<RemoteStore>> Connect(
      const RemoteStoreOptions& options);

  const std::string& address() const { return options_.address; }

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

  explicit RemoteStore(const RemoteStoreOptions& options);

  // Runs one RPC with connection waiting, deadline and (if `retryable`)
  // retries; `what` names the call in errors.
  template <typename Request, typename Response>
  absl::Status Call(absl::string_view what, bool retryable,
                    absl::Duration deadline,
                    grpc::Status (v1::Store::Stub::*method)(
                        grpc::ClientContext*, const Request&, Response*),
                    const Request& request, Response* response);

  // Waits up to connect_timeout for the channel to be ready.
  absl::Status WaitConnected();
  absl::Status Explain(absl::string_view what, const grpc::Status& status,
                       int attempts) const;

  const RemoteStoreOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Store::Stub> stub_;
};

}  // namespace cohort

#endif  // COHORT_CLIENT_REMOTE_STORE_H_

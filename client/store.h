// cohort::Store: the c10d-shaped key-value API that workers program against.
//
// Implementations: RemoteStore (cohortd over gRPC, remote_store.h),
// TcpStoreClient (cohortd's or PyTorch's TCPStore port, tcpstore_client.h),
// FileStore (a shared file, no server, file_store.h) and PrefixStore (a
// namespace inside another store, prefix_store.h); tests also use
// tests/testing/in_process_store.h. The semantics are those of
// proto/cohort/v1/store.proto whichever implementation is used; the c10d
// rules and limits behind them are written once, in proto/c10d/rules.h.
#ifndef COHORT_CLIENT_STORE_H_
#define COHORT_CLIENT_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace cohort {

struct WatchEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  std::string key;
  std::string value;  // Empty for kDelete.
  int64_t revision = 0;
};

struct KeyList {
  std::vector<std::string> keys;
  // The store's revision when the listing began: Watch from revision + 1 to
  // see every later change.
  int64_t revision = 0;
};

// A running watch. Destroying it cancels the watch and waits for its
// callback to return.
class WatchHandle {
 public:
  virtual ~WatchHandle() = default;
  // Stops delivery; the callback is not called after Cancel returns.
  virtual void Cancel() = 0;
  // Blocks until the watch ends: OK after Cancel, else why it ended.
  virtual absl::Status Wait() = 0;
};

// Called for each change, in revision order, on a thread of the watch's own.
using WatchCallback = std::function<void(const WatchEvent&)>;

class Store {
 public:
  virtual ~Store() = default;

  // The timeout of blocking calls that take none (Get, Wait(keys),
  // MultiGet). Default: 300 s, as c10d's.
  absl::Duration timeout() const { return timeout_; }
  void SetTimeout(absl::Duration timeout) { timeout_ = timeout; }

  // Writes `value` under `key`, replacing any value.
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;

  // The value of `key`, blocking until it exists or `timeout` passes
  // (DEADLINE_EXCEEDED naming the key).
  virtual absl::StatusOr<std::string> Get(absl::string_view key,
                                          absl::Duration timeout) = 0;
  absl::StatusOr<std::string> Get(absl::string_view key) {
    return Get(key, timeout_);
  }

  // Adds `delta` to the decimal int64 at `key` (missing counts as 0) and
  // returns the sum. FAILED_PRECONDITION if the value is not an integer.
  virtual absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) = 0;

  // c10d's compare_set: writes `desired` if the current value equals
  // `expected` (or the key is missing and `expected` is empty). Returns
  // `desired` when written, else the current value, or `expected` when the
  // key is missing.
  virtual absl::StatusOr<std::string> CompareSet(absl::string_view key,
                                                 absl::string_view expected,
                                                 absl::string_view desired) = 0;

  // Blocks until all `keys` exist, or DEADLINE_EXCEEDED naming the missing.
  virtual absl::Status Wait(absl::Span<const std::string> keys,
                            absl::Duration timeout) = 0;
  absl::Status Wait(absl::Span<const std::string> keys) {
    return Wait(keys, timeout_);
  }

  // Whether all `keys` exist, without blocking.
  virtual absl::StatusOr<bool> Check(absl::Span<const std::string> keys) = 0;

  // Deletes `key`; returns whether it existed.
  virtual absl::StatusOr<bool> DeleteKey(absl::string_view key) = 0;

  // The number of keys in the whole store (as c10d, also for PrefixStore).
  virtual absl::StatusOr<int64_t> NumKeys() = 0;

  // The values of `keys`, in order, blocking until all exist.
  virtual absl::StatusOr<std::vector<std::string>> MultiGet(
      absl::Span<const std::string> keys, absl::Duration timeout) = 0;
  absl::StatusOr<std::vector<std::string>> MultiGet(
      absl::Span<const std::string> keys) {
    return MultiGet(keys, timeout_);
  }

  // Writes all pairs atomically.
  virtual absl::Status MultiSet(absl::Span<const std::string> keys,
                                absl::Span<const std::string> values) = 0;

  // Appends `value` to the value at `key` (missing counts as empty).
  virtual absl::Status Append(absl::string_view key,
                              absl::string_view value) = 0;

  // Every key starting with `prefix`, in byte order.
  virtual absl::StatusOr<KeyList> ListKeys(absl::string_view prefix) = 0;

  // Calls `callback` for every change to keys starting with `prefix`: from
  // `from_revision` if > 0 (replaying retained history), else from now.
  // Returns once the watch is registered, so every change made after it
  // returns is delivered. OUT_OF_RANGE if from_revision is older than the
  // server's retained history.
  virtual absl::StatusOr<std::unique_ptr<WatchHandle>> Watch(
      absl::string_view prefix, int64_t from_revision,
      WatchCallback callback) = 0;

 private:
  absl::Duration timeout_ = absl::Seconds(300);
};

}  // namespace cohort

#endif  // COHORT_CLIENT_STORE_H_

// InProcessStore: a cohort::Store with no server, backed by the same KvStore
// that cohortd runs (in memory). For tests: it lives in tests/testing/
// because it is where client code meets the server's storage, which nothing
// else may do.
// Thread-safe; blocking calls wait on the calling thread.
#ifndef COHORT_TESTS_TESTING_IN_PROCESS_STORE_H_
#define COHORT_TESTS_TESTING_IN_PROCESS_STORE_H_

#include <memory>

#include "client/store.h"
#include "store/kv_store.h"

namespace cohort {

class InProcessStore final : public Store {
 public:
  explicit InProcessStore(store::StoreLimits limits = {});
  ~InProcessStore() override;

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
  absl::StatusOr<store::ReadResult> Read(absl::Span<const std::string> keys,
                                         bool values, absl::Duration timeout);

  std::unique_ptr<store::KvStore> store_;
};

}  // namespace cohort

#endif  // COHORT_TESTS_TESTING_IN_PROCESS_STORE_H_

// TorchStore: cohort's Store over a torch c10d::Store, so that a cohort
// group bootstraps through the store a torch job already has (the
// PrefixStore that torch.distributed hands a backend).
//
// c10d::Store (PyTorch 1.13) has set, get, add, compare_set, wait, check,
// delete_key and num_keys; those are what cohort's groups need. There
// MultiGet is one get per key (not atomic), and MultiSet and Append return
// UNIMPLEMENTED naming the call; 2.x's Store has multi_get, multi_set and
// append, which they call. ListKeys and Watch have no c10d counterpart and
// return UNIMPLEMENTED.
//
// c10d's stores throw; TorchStore turns what they throw into statuses: a
// message that mentions a timeout becomes DEADLINE_EXCEEDED, any other
// UNAVAILABLE, each naming the call and the key.
#ifndef COHORT_WORKER_TORCH_TORCH_STORE_H_
#define COHORT_WORKER_TORCH_TORCH_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "client/store.h"
#include "torch/csrc/distributed/c10d/Store.hpp"

namespace cohort {

class TorchStore final : public Store {
 public:
  // `store` must not be null. Calls on it may come from any thread.
  explicit TorchStore(c10::intrusive_ptr<c10d::Store> store);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  using Store::Get;
  // Waits for the key for at most `timeout`, then reads it.
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
  const c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_TORCH_TORCH_STORE_H_

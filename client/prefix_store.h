// PrefixStore: a namespace inside another store, as c10d's PrefixStore.
// Key K is stored as "<prefix>/K"; listing and watching strip it again.
#ifndef COHORT_CLIENT_PREFIX_STORE_H_
#define COHORT_CLIENT_PREFIX_STORE_H_

#include <memory>
#include <string>

#include "client/store.h"

namespace cohort {

class PrefixStore final : public Store {
 public:
  // `base` is shared: several PrefixStores (and nested ones) may use it.
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);

  const std::string& prefix() const { return prefix_; }

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
  std::string Key(absl::string_view key) const;
  std::vector<std::string> Keys(absl::Span<const std::string> keys) const;

  const std::string prefix_;  // Includes the trailing '/'.
  std::shared_ptr<Store> base_;
};

}  // namespace cohort

#endif  // COHORT_CLIENT_PREFIX_STORE_H_

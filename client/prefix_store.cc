#include "client/prefix_store.h"

#include "absl/strings/str_cat.h"

namespace cohort {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(absl::StrCat(prefix, "/")), base_(std::move(base)) {
  SetTimeout(base_->timeout());
}

std::string PrefixStore::Key(absl::string_view key) const {
  return absl::StrCat(prefix_, key);
}

std::vector<std::string> PrefixStore::Keys(
    absl::Span<const std::string> keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const std::string& k : keys) out.push_back(Key(k));
  return out;
}

absl::Status PrefixStore::Set(absl::string_view key, absl::string_view value) {
  return base_->Set(Key(key), value);
}

absl::StatusOr<std::string> PrefixStore::Get(absl::string_view key,
                                             absl::Duration timeout) {
  return base_->Get(Key(key), timeout);
}

absl::StatusOr<int64_t> PrefixStore::Add(absl::string_view key,
                                         int64_t delta) {
  return base_->Add(Key(key), delta);
}

absl::StatusOr<std::string> PrefixStore::CompareSet(absl::string_view key,
                                                    absl::string_view expected,
                                                    absl::string_view desired) {
  return base_->CompareSet(Key(key), expected, desired);
}

absl::Status PrefixStore::Wait(absl::Span<const std::string> keys,
                               absl::Duration timeout) {
  return base_->Wait(Keys(keys), timeout);
}

absl::StatusOr<bool> PrefixStore::Check(absl::Span<const std::string> keys) {
  return base_->Check(Keys(keys));
}

absl::StatusOr<bool> PrefixStore::DeleteKey(absl::string_view key) {
  return base_->DeleteKey(Key(key));
}

absl::StatusOr<int64_t> PrefixStore::NumKeys() { return base_->NumKeys(); }

absl::StatusOr<std::vector<std::string>> PrefixStore::MultiGet(
    absl::Span<const std::string> keys, absl::Duration timeout) {
  return base_->MultiGet(Keys(keys), timeout);
}

absl::Status PrefixStore::MultiSet(absl::Span<const std::string> keys,
                                   absl::Span<const std::string> values) {
  return base_->MultiSet(Keys(keys), values);
}

absl::Status PrefixStore::Append(absl::string_view key,
                                 absl::string_view value) {
  return base_->Append(Key(key), value);
}

absl::StatusOr<KeyList> PrefixStore::ListKeys(absl::string_view prefix) {
  absl::StatusOr<KeyList> list = base_->ListKeys(Key(prefix));
  if (!list.ok()) return list;
  for (std::string& k : list->keys) k.erase(0, prefix_.size());
  return list;
}

absl::StatusOr<std::unique_ptr<WatchHandle>> PrefixStore::Watch(
    absl::string_view prefix, int64_t from_revision, WatchCallback callback) {
  const size_t strip = prefix_.size();
  return base_->Watch(Key(prefix), from_revision,
                      [strip, callback = std::move(callback)](
                          const WatchEvent& event) {
                        WatchEvent local = event;
                        local.key.erase(0, strip);
                        callback(local);
                      });
}

}  // namespace cohort

#include "server/coordination/records.h"

#include <optional>

namespace cohort::server {

void ForEachRecord(
    store::KvStore& store, absl::string_view prefix,
    absl::FunctionRef<void(absl::string_view name, const std::string& value)>
        fn) {
  std::string token;
  do {
    absl::StatusOr<store::ListResult> page = store.ListKeys(prefix, 0, token);
    if (!page.ok()) return;
    for (const std::string& key : page->keys) {
      absl::StatusOr<std::optional<std::string>> value = store.TryGet(key);
      if (!value.ok() || !value->has_value()) continue;
      fn(absl::string_view(key).substr(prefix.size()), **value);
    }
    token = std::move(page->next_page_token);
  } while (!token.empty());
}

}  // namespace cohort::server

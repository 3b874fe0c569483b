#include <map>

#include "absl/strings/match.h"
#include "store/kv_engine.h"

namespace cohort::store {
namespace {

class MemoryEngine final : public KvEngine {
 public:
  absl::string_view name() const override { return "memory"; }

  absl::StatusOr<std::optional<std::string>> Get(
      absl::string_view key) const override {
    auto it = data_.find(key);
    if (it == data_.end()) return std::nullopt;
    return it->second;
  }

  bool Contains(absl::string_view key) const override {
    return data_.find(key) != data_.end();
  }

  // Memory is as fast as anything Read() could do later, so the values are
  // copied now.
  std::unique_ptr<PreparedRead> PrepareRead(
      std::vector<std::string> keys) const override {
    class Copied final : public PreparedRead {
     public:
      absl::StatusOr<std::vector<std::string>> Read() override {
        return std::move(values);
      }
      std::vector<std::string> values;
    };
    auto read = std::make_unique<Copied>();
    read->values.reserve(keys.size());
    for (const std::string& key : keys) {
      auto it = data_.find(key);
      read->values.push_back(it == data_.end() ? std::string() : it->second);
    }
    return read;
  }

  absl::Status Apply(absl::Span<const Mutation> mutations,
                     int64_t revision) override {
    for (const Mutation& m : mutations) {
      if (m.kind == Mutation::Kind::kPut) {
        data_.insert_or_assign(m.key, m.value);
      } else {
        auto it = data_.find(m.key);
        if (it != data_.end()) data_.erase(it);
      }
    }
    revision_ = revision;
    return absl::OkStatus();
  }

  int64_t revision() const override { return revision_; }

  int64_t NumKeys() const override { return data_.size(); }

  absl::StatusOr<int64_t> CountKeys(absl::string_view prefix) const override {
    int64_t n = 0;
    for (auto it = data_.lower_bound(prefix);
         it != data_.end() && absl::StartsWith(it->first, prefix); ++it) {
      ++n;
    }
    return n;
  }

  absl::StatusOr<std::vector<std::string>> ListKeys(
      absl::string_view prefix, absl::string_view start_after,
      size_t limit) const override {
    std::vector<std::string> keys;
    auto it = !start_after.empty() ? data_.upper_bound(start_after)
                                   : data_.lower_bound(prefix);
    for (; it != data_.end() && keys.size() < limit; ++it) {
      if (!absl::StartsWith(it->first, prefix)) break;
      keys.push_back(it->first);
    }
    return keys;
  }

  absl::Status Flush() override { return absl::OkStatus(); }

 private:
  std::map<std::string, std::string, std::less<>> data_;
  int64_t revision_ = 0;
};

}  // namespace

std::unique_ptr<KvEngine> NewMemoryEngine() {
  return std::make_unique<MemoryEngine>();
}

}  // namespace cohort::store

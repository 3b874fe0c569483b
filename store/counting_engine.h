// CountingEngine: a KvEngine that forwards every call to another and counts
// the work written and read through it. Tests use it to assert how much
// store work an operation costs (writes, keys rewritten, bytes), which,
// unlike a duration, is the same on every machine.
#ifndef COHORT_STORE_COUNTING_ENGINE_H_
#define COHORT_STORE_COUNTING_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "store/kv_engine.h"

namespace cohort::store {

// What went through a CountingEngine so far.
struct EngineWork {
  uint64_t applies = 0;        // Apply calls (one per store write batch).
  uint64_t mutations = 0;      // Keys put or deleted.
  uint64_t bytes_written = 0;  // Keys and values of those mutations.
  uint64_t gets = 0;           // Get calls.
  uint64_t bytes_read = 0;     // Values Get returned.

  EngineWork operator-(const EngineWork& o) const {
    return {applies - o.applies, mutations - o.mutations,
            bytes_written - o.bytes_written, gets - o.gets,
            bytes_read - o.bytes_read};
  }
};

class CountingEngine : public KvEngine {
 public:
  explicit CountingEngine(std::unique_ptr<KvEngine> engine)
      : engine_(std::move(engine)) {}

  // A snapshot of the counts; thread-safe.
  EngineWork work() const {
    return {applies_.load(), mutations_.load(), bytes_written_.load(),
            gets_.load(), bytes_read_.load()};
  }

  absl::string_view name() const override { return engine_->name(); }
  absl::StatusOr<std::optional<std::string>> Get(
      absl::string_view key) const override {
    auto value = engine_->Get(key);
    ++gets_;
    if (value.ok() && value->has_value()) bytes_read_ += (*value)->size();
    return value;
  }
  bool Contains(absl::string_view key) const override {
    return engine_->Contains(key);
  }
  std::unique_ptr<PreparedRead> PrepareRead(
      std::vector<std::string> keys) const override {
    return engine_->PrepareRead(std::move(keys));
  }
  absl::Status Apply(absl::Span<const Mutation> mutations,
                     int64_t revision) override {
    ++applies_;
    mutations_ += mutations.size();
    for (const Mutation& m : mutations) {
      bytes_written_ += m.key.size() + m.value.size();
    }
    return engine_->Apply(mutations, revision);
  }
  int64_t revision() const override { return engine_->revision(); }
  int64_t NumKeys() const override { return engine_->NumKeys(); }
  absl::StatusOr<int64_t> CountKeys(absl::string_view prefix) const override {
    return engine_->CountKeys(prefix);
  }
  absl::StatusOr<std::vector<std::string>> ListKeys(
      absl::string_view prefix, absl::string_view start_after,
      size_t limit) const override {
    return engine_->ListKeys(prefix, start_after, limit);
  }
  absl::Status Flush() override { return engine_->Flush(); }

 private:
  std::unique_ptr<KvEngine> engine_;
  std::atomic<uint64_t> applies_{0}, mutations_{0}, bytes_written_{0};
  mutable std::atomic<uint64_t> gets_{0}, bytes_read_{0};
};

}  // namespace cohort::store

#endif  // COHORT_STORE_COUNTING_ENGINE_H_

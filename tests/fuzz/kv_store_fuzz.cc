// kv_store_fuzz: a model check of KvStore (over the memory engine).
//
// The input is a program of KvStore calls. Each call's result is checked
// against a plain std::map and a list of changes that implement the
// documented rules (docs/store-api.md, proto/cohort/v1/store.proto,
// store/kv_store.h) in the simplest way: values; c10d's compare_set; add's
// FAILED_PRECONDITION and OUT_OF_RANGE; INVALID_ARGUMENT for every limit;
// one revision per mutation, and none for a call that changes nothing;
// NumKeys; ListKeys pages; waits completing exactly when their keys exist;
// watches delivering exactly the matching changes from their start, in
// order; and at the end every wait and watch ended exactly once.
//
// Small limits make the limits reachable: keys of 8 bytes, values of 16,
// 4 keys a call, pages of 3 keys, a watch history of 6 changes.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"
#include "tests/fuzz/fuzz_input.h"

namespace cohort::store {
namespace {

using absl::StatusCode;
using fuzz::FuzzInput;

StoreLimits Limits() {
  StoreLimits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  limits.max_keys_per_call = 4;
  limits.max_list_page = 3;
  limits.history_events = 6;
  // Only the event count bounds the history: its byte size is the engine's
  // business (sizeof(Event)), not a rule the model can state.
  limits.history_bytes = size_t{1} << 40;
  return limits;
}

// Waits that should block get this; the fuzzer never sees it pass.
constexpr absl::Duration kLongTimeout = absl::Hours(1);

// The call being checked, printed with any failure.
std::string current_call;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "kv_store_fuzz: model check failed in %s: %s\n",
               current_call.c_str(), what.c_str());
  std::abort();
}

#define MODEL_CHECK(cond, ...)                                  \
  do {                                                          \
    if (!(cond)) Fail(absl::StrCat(#cond, " ", ##__VA_ARGS__)); \
  } while (0)

std::string Q(absl::string_view s) {
  return absl::StrCat("\"", absl::CHexEscape(s), "\"");
}

std::string Show(const absl::Status& s) { return s.ToString(); }

template <typename T>
void ExpectError(const absl::StatusOr<T>& r, StatusCode code) {
  MODEL_CHECK(r.status().code() == code, "expected ",
              absl::StatusCodeToString(code), ", got ", Show(r.status()));
}

template <typename T>
const T& ExpectOk(const absl::StatusOr<T>& r) {
  MODEL_CHECK(r.ok(), "expected OK, got ", Show(r.status()));
  return *r;
}

struct ModelEvent {
  int64_t revision;
  bool put;
  std::string key;
  std::string value;

  bool operator==(const ModelEvent& o) const {
    return revision == o.revision && put == o.put && key == o.key &&
           value == o.value;
  }
};

std::string Show(const ModelEvent& e) {
  return absl::StrCat(e.revision, e.put ? " PUT " : " DEL ", Q(e.key),
                      e.put ? " " + Q(e.value) : "");
}

// One WaitForKeys call and what came back.
struct WaitRecord {
  std::vector<std::string> keys;
  bool read_values = false;
  bool long_timeout = true;
  KvStore::WaitId id = 0;
  bool cancelled = false;
  // Written by the callback, which for a timed-out wait runs on the store's
  // timer thread.
  std::mutex mu;
  int calls = 0;
  absl::Status status;
  ReadResult result;
};

struct WatchRecord {
  std::string prefix;
  int64_t start_revision = 0;
  KvStore::WatchId id = 0;
  bool cancelled = false;
  // Filled under the store's lock, on the calling thread.
  std::vector<ModelEvent> received;
  size_t received_at_cancel = 0;
  // How far CheckWatch got: model_.events before this index, and received
  // events before `checked`, have been compared.
  size_t next_model_event = 0;
  size_t checked = 0;
  int closes = 0;
  absl::Status close_status;
};

class Model {
 public:
  const StoreLimits limits = Limits();
  std::map<std::string, std::string> data;
  int64_t revision = 0;
  std::vector<ModelEvent> events;  // Every change, in order.
  // The watch history: events[history_begin...]; changes at or below
  // compacted are gone. Whole revisions are dropped.
  size_t history_begin = 0;
  int64_t compacted = 0;

  bool KeyOk(absl::string_view k) const {
    return !k.empty() && k.size() <= limits.max_key_bytes;
  }
  bool ValueOk(absl::string_view v) const {
    return v.size() <= limits.max_value_bytes;
  }
  bool KeysOk(const std::vector<std::string>& keys) const {
    if (keys.size() > limits.max_keys_per_call) return false;
    for (const std::string& k : keys) {
      if (!KeyOk(k)) return false;
    }
    return true;
  }
  std::optional<std::string> Get(const std::string& k) const {
    auto it = data.find(k);
    if (it == data.end()) return std::nullopt;
    return it->second;
  }

  // Applies one revision: puts (value set) and deletes (nullopt).
  void Commit(
      const std::vector<std::pair<std::string, std::optional<std::string>>>&
          changes) {
    ++revision;
    for (const auto& [key, value] : changes) {
      if (value) {
        data[key] = *value;
      } else {
        data.erase(key);
      }
      events.push_back({revision, value.has_value(), key, value.value_or("")});
    }
    while (events.size() - history_begin > limits.history_events) {
      const int64_t dropped = events[history_begin].revision;
      while (history_begin < events.size() &&
             events[history_begin].revision == dropped) {
        ++history_begin;
      }
      compacted = dropped;
    }
  }
};

class Harness {
 public:
  Harness()
      : store_(std::make_unique<KvStore>(NewMemoryEngine(), model_.limits)) {}

  void Run(FuzzInput& in) {
    for (int step = 0; !in.empty() && step < 2000; ++step) {
      Step(in);
      CheckAfterCall();
    }
    current_call = "a final sweep";
    CheckEverything();
    Close();
  }

 private:
  // Keys from a small pool, so that calls meet; sometimes raw bytes, which
  // can be empty or over the limit.
  std::string Key(FuzzInput& in) {
    static const char* const kPool[] = {"a",   "b",   "ab",  "abc",
                                        "a/1", "a/2", "b/1", "12345678"};
    const uint8_t b = in.Byte();
    if (b < 224) return kPool[b % 8];
    return in.Bytes(model_.limits.max_key_bytes + 2);
  }
  std::string Prefix(FuzzInput& in) {
    static const char* const kPool[] = {"", "a", "a/", "b", "ab", "z"};
    const uint8_t b = in.Byte();
    if (b < 224) return kPool[b % 6];
    return in.Bytes(model_.limits.max_key_bytes + 2);
  }
  std::string Value(FuzzInput& in) {
    static const char* const kPool[] = {"",
                                        "x",
                                        "0",
                                        "1",
                                        "-1",
                                        "9223372036854775807",
                                        "-9223372036854775808",
                                        " 7",
                                        "+3",
                                        "1x"};
    const uint8_t b = in.Byte();
    if (b < 160) return kPool[b % 10];
    if (b < 224) return absl::StrCat(static_cast<int8_t>(in.Byte()));
    return in.Bytes(model_.limits.max_value_bytes + 2);
  }
  int64_t Delta(FuzzInput& in) {
    switch (in.Pick(5)) {
      case 0:
        return INT64_MAX;
      case 1:
        return INT64_MIN;
      case 2:
        return in.I64();
      default:
        return static_cast<int8_t>(in.Byte());
    }
  }
  std::vector<std::string> Keys(FuzzInput& in) {
    std::vector<std::string> keys(in.Pick(model_.limits.max_keys_per_call + 2));
    for (std::string& k : keys) k = Key(in);
    return keys;
  }

  // Each argument is read in its own statement: the order in which a
  // call's arguments are evaluated differs between gcc and clang, and an
  // input must mean the same program to both (the corpus replays under
  // gcc what libFuzzer found under clang).
  void Step(FuzzInput& in) {
    switch (in.Pick(16)) {
      case 0: {
        std::string key = Key(in);
        return Set(key, Value(in));
      }
      case 1: {
        std::string key = Key(in);
        return Add(key, Delta(in));
      }
      case 2: {
        std::string key = Key(in);
        std::string expected = Value(in);
        return CompareSet(key, expected, Value(in));
      }
      case 3: {
        std::string key = Key(in);
        return Append(key, Value(in));
      }
      case 4:
        return Delete(Key(in));
      case 5: {
        std::vector<std::string> keys = Keys(in);
        std::vector<std::string> values(keys.size());
        for (std::string& v : values) v = Value(in);
        // Now and then a count that does not match.
        if (in.Pick(8) == 0) values.resize(in.Pick(4));
        return MultiSet(keys, values);
      }
      case 6:
        return Check(Keys(in));
      case 7:
        return TryGet(Key(in));
      case 8:
        return NumKeys();
      case 9: {
        std::string prefix = Prefix(in);
        const size_t page = in.Pick(model_.limits.max_list_page + 2);
        std::string token = in.Pick(2) ? "" : prefix + Key(in);
        if (in.Pick(8) == 0) token = Key(in);  // Maybe not under prefix.
        return ListKeys(prefix, page, token);
      }
      case 10: {
        std::string prefix = Prefix(in);
        return ListAll(prefix, in.Pick(model_.limits.max_list_page + 1));
      }
      case 11:
      case 12: {
        std::vector<std::string> keys = Keys(in);
        const uint8_t how = in.Byte();
        return Wait(std::move(keys), how & 1, (how & 2) == 0);
      }
      case 13:
        return CancelWait(in.Byte());
      case 14: {
        std::string prefix = Prefix(in);
        int64_t from = 0;
        switch (in.Pick(4)) {
          case 0:
            break;
          case 1:
            from = model_.revision + 1 - in.Pick(model_.revision + 2);
            break;
          case 2:
            from = model_.revision + 1 + in.Pick(3);
            break;
          default:
            from = in.I64();
        }
        return Watch(prefix, from);
      }
      case 15:
        return CancelWatch(in.Byte());
    }
  }

  void Set(const std::string& key, const std::string& value) {
    current_call = absl::StrCat("Set(", Q(key), ", ", Q(value), ")");
    absl::StatusOr<int64_t> r = store_->Set(key, value);
    if (!model_.KeyOk(key) || !model_.ValueOk(value)) {
      return ExpectError(r, StatusCode::kInvalidArgument);
    }
    model_.Commit({{key, value}});
    MODEL_CHECK(ExpectOk(r) == model_.revision);
  }

  void Add(const std::string& key, int64_t delta) {
    current_call = absl::StrCat("Add(", Q(key), ", ", delta, ")");
    absl::StatusOr<AddResult> r = store_->Add(key, delta);
    if (!model_.KeyOk(key)) return ExpectError(r, StatusCode::kInvalidArgument);
    // The stored text is a decimal int64 as absl::SimpleAtoi reads one.
    int64_t current = 0, sum = 0;
    std::optional<std::string> old = model_.Get(key);
    if (old && !absl::SimpleAtoi(*old, &current)) {
      return ExpectError(r, StatusCode::kFailedPrecondition);
    }
    if (__builtin_add_overflow(current, delta, &sum)) {
      return ExpectError(r, StatusCode::kOutOfRange);
    }
    model_.Commit({{key, absl::StrCat(sum)}});
    MODEL_CHECK(ExpectOk(r).value == sum, r->value, " != ", sum);
    MODEL_CHECK(r->revision == model_.revision);
  }

  void CompareSet(const std::string& key, const std::string& expected,
                  const std::string& desired) {
    current_call = absl::StrCat("CompareSet(", Q(key), ", ", Q(expected), ", ",
                                Q(desired), ")");
    absl::StatusOr<CompareSetResult> r =
        store_->CompareSet(key, expected, desired);
    if (!model_.KeyOk(key) || !model_.ValueOk(desired)) {
      return ExpectError(r, StatusCode::kInvalidArgument);
    }
    const CompareSetResult& got = ExpectOk(r);
    std::optional<std::string> current = model_.Get(key);
    // docs/store-api.md: missing+empty writes; missing+non-empty returns
    // expected; equal writes; anything else returns the current value.
    const bool writes = current ? *current == expected : expected.empty();
    if (writes) model_.Commit({{key, desired}});
    const std::string returned = writes ? desired : current.value_or(expected);
    MODEL_CHECK(got.value == returned, Q(got.value), " != ", Q(returned));
    MODEL_CHECK(got.swapped == writes);
    MODEL_CHECK(got.revision == model_.revision, got.revision);
  }

  void Append(const std::string& key, const std::string& value) {
    current_call = absl::StrCat("Append(", Q(key), ", ", Q(value), ")");
    absl::StatusOr<int64_t> r = store_->Append(key, value);
    const std::string result = model_.Get(key).value_or("") + value;
    if (!model_.KeyOk(key) || !model_.ValueOk(result)) {
      return ExpectError(r, StatusCode::kInvalidArgument);
    }
    model_.Commit({{key, result}});
    MODEL_CHECK(ExpectOk(r) == model_.revision);
  }

  void Delete(const std::string& key) {
    current_call = absl::StrCat("Delete(", Q(key), ")");
    absl::StatusOr<DeleteResult> r = store_->Delete(key);
    if (!model_.KeyOk(key)) return ExpectError(r, StatusCode::kInvalidArgument);
    const bool existed = model_.data.count(key) > 0;
    if (existed) model_.Commit({{key, std::nullopt}});
    MODEL_CHECK(ExpectOk(r).deleted == existed);
    MODEL_CHECK(r->revision == model_.revision);
  }

  void MultiSet(const std::vector<std::string>& keys,
                const std::vector<std::string>& values) {
    current_call = absl::StrCat("MultiSet({", absl::StrJoin(keys, ", "), "}, ",
                                values.size(), " values)");
    absl::StatusOr<int64_t> r = store_->MultiSet(keys, values);
    bool valid = keys.size() == values.size() && model_.KeysOk(keys);
    for (const std::string& v : values) valid = valid && model_.ValueOk(v);
    if (!valid) return ExpectError(r, StatusCode::kInvalidArgument);
    if (!keys.empty()) {
      std::vector<std::pair<std::string, std::optional<std::string>>> changes;
      for (size_t i = 0; i < keys.size(); ++i) {
        changes.emplace_back(keys[i], values[i]);
      }
      model_.Commit(changes);
    }
    MODEL_CHECK(ExpectOk(r) == model_.revision);
  }

  void Check(const std::vector<std::string>& keys) {
    current_call = absl::StrCat("Check({", absl::StrJoin(keys, ", "), "})");
    absl::StatusOr<CheckResult> r = store_->Check(keys);
    if (!model_.KeysOk(keys)) {
      return ExpectError(r, StatusCode::kInvalidArgument);
    }
    bool all = true;
    for (const std::string& k : keys) all = all && model_.data.count(k) > 0;
    MODEL_CHECK(ExpectOk(r).all_exist == all);
    MODEL_CHECK(r->revision == model_.revision);
  }

  void TryGet(const std::string& key) {
    current_call = absl::StrCat("TryGet(", Q(key), ")");
    absl::StatusOr<std::optional<std::string>> r = store_->TryGet(key);
    if (!model_.KeyOk(key)) return ExpectError(r, StatusCode::kInvalidArgument);
    const std::optional<std::string> want = model_.Get(key);
    MODEL_CHECK(ExpectOk(r) == want, r->value_or("(none)"),
                " != ", want.value_or("(none)"));
  }

  void NumKeys() {
    current_call = "NumKeys()";
    absl::StatusOr<NumKeysResult> got = store_->NumKeys();
    const NumKeysResult& r = ExpectOk(got);
    MODEL_CHECK(r.num_keys == static_cast<int64_t>(model_.data.size()),
                r.num_keys, " != ", model_.data.size());
    MODEL_CHECK(r.revision == model_.revision);
  }

  // The keys under `prefix` after `token` (all if empty), in byte order.
  std::vector<std::string> ModelKeys(const std::string& prefix,
                                     const std::string& token) const {
    std::vector<std::string> keys;
    for (const auto& [k, v] : model_.data) {
      if (absl::StartsWith(k, prefix) && (token.empty() || k > token)) {
        keys.push_back(k);
      }
    }
    return keys;
  }

  void ListKeys(const std::string& prefix, size_t page_size,
                const std::string& token) {
    current_call = absl::StrCat("ListKeys(", Q(prefix), ", ", page_size, ", ",
                                Q(token), ")");
    absl::StatusOr<ListResult> r = store_->ListKeys(prefix, page_size, token);
    if (prefix.size() > model_.limits.max_key_bytes ||
        page_size > model_.limits.max_list_page ||
        (!token.empty() && !absl::StartsWith(token, prefix))) {
      return ExpectError(r, StatusCode::kInvalidArgument);
    }
    const size_t page =
        page_size == 0 ? model_.limits.max_list_page : page_size;
    std::vector<std::string> want = ModelKeys(prefix, token);
    const bool more = want.size() > page;
    if (more) want.resize(page);
    const ListResult& got = ExpectOk(r);
    MODEL_CHECK(got.keys == want, "got {", absl::StrJoin(got.keys, ", "),
                "}, want {", absl::StrJoin(want, ", "), "}");
    MODEL_CHECK(got.next_page_token == (more ? want.back() : ""),
                Q(got.next_page_token));
    MODEL_CHECK(got.revision == model_.revision);
  }

  // Follows next_page_token to the end: every key under the prefix once,
  // in order, in at most (keys / page) + 1 pages.
  void ListAll(const std::string& prefix, size_t page_size) {
    current_call = absl::StrCat("ListAll(", Q(prefix), ", ", page_size, ")");
    const std::vector<std::string> want = ModelKeys(prefix, "");
    if (prefix.size() > model_.limits.max_key_bytes) return;
    const size_t page =
        page_size == 0 ? model_.limits.max_list_page : page_size;
    std::vector<std::string> got;
    std::string token;
    for (size_t pages = 0;; ++pages) {
      MODEL_CHECK(pages <= want.size() / page + 1, "too many pages; so far {",
                  absl::StrJoin(got, ", "), "}");
      absl::StatusOr<ListResult> listed =
          store_->ListKeys(prefix, page_size, token);
      const ListResult& r = ExpectOk(listed);
      MODEL_CHECK(r.keys.size() <= page);
      got.insert(got.end(), r.keys.begin(), r.keys.end());
      if (r.next_page_token.empty()) break;
      MODEL_CHECK(!r.keys.empty() && r.next_page_token == r.keys.back());
      token = r.next_page_token;
    }
    MODEL_CHECK(got == want, "got {", absl::StrJoin(got, ", "), "}, want {",
                absl::StrJoin(want, ", "), "}");
  }

  void Wait(std::vector<std::string> keys, bool read_values,
            bool long_timeout) {
    if (waits_.size() >= kMaxWaits) return;
    current_call =
        absl::StrCat("WaitForKeys({", absl::StrJoin(keys, ", "), "}, ",
                     read_values, ", ", long_timeout ? "1h" : "0", ")");
    auto w = std::make_shared<WaitRecord>();
    w->keys = keys;
    w->read_values = read_values;
    w->long_timeout = long_timeout;
    w->id =
        store_->WaitForKeys(std::move(keys), read_values,
                            long_timeout ? kLongTimeout : absl::ZeroDuration(),
                            [w](absl::StatusOr<ReadResult> r) {
                              std::lock_guard<std::mutex> lock(w->mu);
                              ++w->calls;
                              w->status = r.status();
                              if (r.ok()) w->result = std::move(*r);
                            });
    if (!model_.KeysOk(w->keys)) {
      std::lock_guard<std::mutex> lock(w->mu);
      MODEL_CHECK(w->id == 0 && w->calls == 1);
      MODEL_CHECK(w->status.code() == StatusCode::kInvalidArgument,
                  Show(w->status));
      return;
    }
    // All there now: done before WaitForKeys returns (which may then
    // return 0, or an id that CancelWait ignores).
    if (AllExist(w->keys)) {
      std::lock_guard<std::mutex> lock(w->mu);
      MODEL_CHECK(w->calls == 1, w->calls);
      CheckWaitResult(*w);
      return;
    }
    MODEL_CHECK(w->id != 0);
    waits_.push_back(std::move(w));
  }

  void CancelWait(size_t which) {
    if (waits_.empty()) return;
    WaitRecord& w = *waits_[which % waits_.size()];
    current_call = absl::StrCat("CancelWait(", w.id, ")");
    if (!w.long_timeout) return;  // May be running on the timer thread.
    store_->CancelWait(w.id);
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.calls == 0) w.cancelled = true;
  }

  void Watch(const std::string& prefix, int64_t from) {
    if (watches_.size() >= kMaxWatches) return;
    current_call = absl::StrCat("Watch(", Q(prefix), ", ", from, ")");
    auto w = std::make_shared<WatchRecord>();
    w->prefix = prefix;
    absl::StatusOr<KvStore::WatchStart> r = store_->Watch(
        prefix, from,
        [w](std::vector<Event> events) {
          for (Event& e : events) {
            w->received.push_back({e.revision, e.type == Event::Type::kPut,
                                   std::move(e.key),
                                   e.value ? *e.value : std::string()});
          }
        },
        [w](absl::Status s) {
          ++w->closes;
          w->close_status = std::move(s);
        });
    if (prefix.size() > model_.limits.max_key_bytes || from < 0) {
      return ExpectError(r, StatusCode::kInvalidArgument);
    }
    if (from != 0 && from <= model_.compacted) {
      return ExpectError(r, StatusCode::kOutOfRange);
    }
    if (from > model_.revision + 1 && !r.ok()) {
      // A revision not yet made: refusing it is as good as waiting for it.
      MODEL_CHECK(r.status().code() == StatusCode::kInvalidArgument ||
                      r.status().code() == StatusCode::kOutOfRange,
                  Show(r.status()));
      return;
    }
    w->id = ExpectOk(r).id;
    w->start_revision = r->start_revision;
    MODEL_CHECK(w->start_revision == (from == 0 ? model_.revision + 1 : from),
                w->start_revision);
    watches_.push_back(std::move(w));
  }

  void CancelWatch(size_t which) {
    if (watches_.empty()) return;
    WatchRecord& w = *watches_[which % watches_.size()];
    current_call = absl::StrCat("CancelWatch(", w.id, ")");
    store_->CancelWatch(w.id);
    if (!w.cancelled) w.received_at_cancel = w.received.size();
    w.cancelled = true;
  }

  bool AllExist(const std::vector<std::string>& keys) const {
    for (const std::string& k : keys) {
      if (model_.data.count(k) == 0) return false;
    }
    return true;
  }

  // A wait that completed now: OK, at this revision, with today's values.
  void CheckWaitResult(const WaitRecord& w) {
    MODEL_CHECK(w.status.ok(), Show(w.status));
    MODEL_CHECK(w.result.revision == model_.revision, w.result.revision);
    if (!w.read_values) {
      MODEL_CHECK(w.result.values.empty());
      return;
    }
    std::vector<std::string> want;
    for (const std::string& k : w.keys) want.push_back(model_.data.at(k));
    MODEL_CHECK(w.result.values == want, "got {",
                absl::StrJoin(w.result.values, ", "), "}, want {",
                absl::StrJoin(want, ", "), "}");
  }

  void CheckAfterCall() {
    MODEL_CHECK(store_->revision() == model_.revision, store_->revision());
    // Blocked waits (1h): done exactly when all their keys exist, which in
    // this single-threaded program is during the call that made it so.
    for (auto it = waits_.begin(); it != waits_.end();) {
      WaitRecord& w = **it;
      std::lock_guard<std::mutex> lock(w.mu);
      if (!w.long_timeout) {
        ++it;
        continue;
      }
      if (w.cancelled) {
        MODEL_CHECK(w.calls == 0, "a cancelled wait was called");
        ++it;
        continue;
      }
      if (!AllExist(w.keys)) {
        MODEL_CHECK(w.calls == 0, "wait {", absl::StrJoin(w.keys, ", "),
                    "} ended with ", Show(w.status),
                    " though a key is missing");
        ++it;
        continue;
      }
      MODEL_CHECK(w.calls == 1, "wait {", absl::StrJoin(w.keys, ", "),
                  "} not done though all its keys exist");
      CheckWaitResult(w);
      it = waits_.erase(it);
    }
    for (const auto& w : watches_) CheckWatch(*w);
  }

  // A live watch has had exactly the changes to its prefix from its start,
  // in order: checked incrementally, from the model's changes made since
  // the last check.
  void CheckWatch(WatchRecord& w) {
    if (w.cancelled) {
      MODEL_CHECK(w.received.size() == w.received_at_cancel,
                  "events after CancelWatch");
      return;
    }
    for (; w.next_model_event < model_.events.size(); ++w.next_model_event) {
      const ModelEvent& e = model_.events[w.next_model_event];
      if (e.revision < w.start_revision || !absl::StartsWith(e.key, w.prefix)) {
        continue;
      }
      MODEL_CHECK(w.checked < w.received.size() && w.received[w.checked] == e,
                  "watch ", Q(w.prefix), " from ", w.start_revision, " got ",
                  w.checked < w.received.size() ? Show(w.received[w.checked])
                                                : "nothing",
                  ", want ", Show(e));
      ++w.checked;
    }
    MODEL_CHECK(w.received.size() == w.checked, "watch ", Q(w.prefix), " from ",
                w.start_revision, " got an extra event ",
                Show(w.received[w.checked]));
  }

  void CheckEverything() {
    for (const std::string& k : ModelKeys("", "")) TryGet(k);
    ListAll("", 0);
    NumKeys();
  }

  // Shuts the store down: every wait and watch still open ends exactly once.
  void Close() {
    current_call = "~KvStore()";
    store_.reset();
    for (const auto& w : waits_) {
      std::lock_guard<std::mutex> lock(w->mu);
      if (w->cancelled) {
        MODEL_CHECK(w->calls == 0, "a cancelled wait was called");
        continue;
      }
      MODEL_CHECK(w->calls == 1, "wait {", absl::StrJoin(w->keys, ", "),
                  "} called ", w->calls, " times");
      if (w->long_timeout) {
        MODEL_CHECK(w->status.code() == StatusCode::kUnavailable,
                    Show(w->status));
      } else {
        // Timed out, or ended by a later call or by the shutdown.
        MODEL_CHECK(w->status.code() == StatusCode::kDeadlineExceeded ||
                        w->status.code() == StatusCode::kUnavailable ||
                        w->status.ok(),
                    Show(w->status));
      }
    }
    for (const auto& w : watches_) {
      MODEL_CHECK(w->closes == (w->cancelled ? 0 : 1), w->closes);
      if (!w->cancelled) {
        MODEL_CHECK(w->close_status.code() == StatusCode::kUnavailable,
                    Show(w->close_status));
      }
    }
  }

  // Calls pile up blocked waits and watches; past these, new ones are
  // skipped so that each call stays cheap.
  static constexpr size_t kMaxWaits = 64;
  static constexpr size_t kMaxWatches = 16;

  Model model_;
  std::unique_ptr<KvStore> store_;
  std::vector<std::shared_ptr<WaitRecord>> waits_;
  std::vector<std::shared_ptr<WatchRecord>> watches_;
};

}  // namespace
}  // namespace cohort::store

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  cohort::fuzz::FuzzInput in(data, size);
  cohort::store::Harness harness;
  harness.Run(in);
  return 0;
}

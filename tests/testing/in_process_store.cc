#include "tests/testing/in_process_store.h"

#include <deque>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "store/kv_engine.h"

namespace cohort {
namespace {

WatchEvent ToWatchEvent(const store::Event& e) {
  WatchEvent out;
  out.type = e.type == store::Event::Type::kPut ? WatchEvent::Type::kPut
                                                : WatchEvent::Type::kDelete;
  out.key = e.key;
  if (e.value) out.value = *e.value;
  out.revision = e.revision;
  return out;
}

// KvStore delivers events under its lock; this hands them to the user's
// callback on a thread of its own, so the callback may use the store.
class InProcessWatch final : public WatchHandle {
 public:
  InProcessWatch(store::KvStore* store, WatchCallback callback)
      : store_(store), callback_(std::move(callback)) {}

  ~InProcessWatch() override { Cancel(); }

  void Start(store::KvStore::WatchId id) {
    id_ = id;
    thread_ = std::thread([this] { Deliver(); });
  }

  void Push(std::vector<store::Event> events) {
    absl::MutexLock lock(&mu_);
    for (const store::Event& e : events) queue_.push_back(ToWatchEvent(e));
  }

  void Close(absl::Status status) {
    absl::MutexLock lock(&mu_);
    if (!ended_) {
      ended_ = true;
      status_ = std::move(status);
    }
  }

  void Cancel() override {
    store_->CancelWatch(id_);
    Close(absl::OkStatus());
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
      thread_.join();
    }
  }

  absl::Status Wait() override {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&drained_));
    return status_;
  }

 private:
  void Deliver() {
    for (;;) {
      WatchEvent event;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return ended_ || !queue_.empty();
        };
        mu_.Await(absl::Condition(&ready));
        if (ended_ && (queue_.empty() || status_.ok())) {
          drained_ = true;
          return;
        }
        event = std::move(queue_.front());
        queue_.pop_front();
      }
      callback_(event);
    }
  }

  store::KvStore* const store_;
  const WatchCallback callback_;
  store::KvStore::WatchId id_ = 0;
  std::thread thread_;
  absl::Mutex mu_;
  std::deque<WatchEvent> queue_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool drained_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

InProcessStore::InProcessStore(store::StoreLimits limits)
    : store_(
          std::make_unique<store::KvStore>(store::NewMemoryEngine(), limits)) {}

InProcessStore::~InProcessStore() = default;

absl::StatusOr<store::ReadResult> InProcessStore::Read(
    absl::Span<const std::string> keys, bool values, absl::Duration timeout) {
  absl::Notification done;
  absl::StatusOr<store::ReadResult> result;
  store_->WaitForKeys(std::vector<std::string>(keys.begin(), keys.end()),
                      values, timeout,
                      [&](absl::StatusOr<store::ReadResult> r) {
                        result = std::move(r);
                        done.Notify();
                      });
  done.WaitForNotification();
  return result;
}

absl::Status InProcessStore::Set(absl::string_view key,
                                 absl::string_view value) {
  return store_->Set(key, value).status();
}

absl::StatusOr<std::string> InProcessStore::Get(absl::string_view key,
                                                absl::Duration timeout) {
  absl::StatusOr<store::ReadResult> r = Read({std::string(key)}, true, timeout);
  if (!r.ok()) return r.status();
  return std::move(r->values.front());
}

absl::StatusOr<int64_t> InProcessStore::Add(absl::string_view key,
                                            int64_t delta) {
  absl::StatusOr<store::AddResult> r = store_->Add(key, delta);
  if (!r.ok()) return r.status();
  return r->value;
}

absl::StatusOr<std::string> InProcessStore::CompareSet(
    absl::string_view key, absl::string_view expected,
    absl::string_view desired) {
  absl::StatusOr<store::CompareSetResult> r =
      store_->CompareSet(key, expected, desired);
  if (!r.ok()) return r.status();
  return std::move(r->value);
}

absl::Status InProcessStore::Wait(absl::Span<const std::string> keys,
                                  absl::Duration timeout) {
  return Read(keys, false, timeout).status();
}

absl::StatusOr<bool> InProcessStore::Check(absl::Span<const std::string> keys) {
  absl::StatusOr<store::CheckResult> r = store_->Check(keys);
  if (!r.ok()) return r.status();
  return r->all_exist;
}

absl::StatusOr<bool> InProcessStore::DeleteKey(absl::string_view key) {
  absl::StatusOr<store::DeleteResult> r = store_->Delete(key);
  if (!r.ok()) return r.status();
  return r->deleted;
}

absl::StatusOr<int64_t> InProcessStore::NumKeys() {
  absl::StatusOr<store::NumKeysResult> r = store_->NumKeys();
  if (!r.ok()) return r.status();
  return r->num_keys;
}

absl::StatusOr<std::vector<std::string>> InProcessStore::MultiGet(
    absl::Span<const std::string> keys, absl::Duration timeout) {
  absl::StatusOr<store::ReadResult> r = Read(keys, true, timeout);
  if (!r.ok()) return r.status();
  return std::move(r->values);
}

absl::Status InProcessStore::MultiSet(absl::Span<const std::string> keys,
                                      absl::Span<const std::string> values) {
  return store_->MultiSet(keys, values).status();
}

absl::Status InProcessStore::Append(absl::string_view key,
                                    absl::string_view value) {
  return store_->Append(key, value).status();
}

absl::StatusOr<KeyList> InProcessStore::ListKeys(absl::string_view prefix) {
  KeyList list;
  std::string token;
  do {
    absl::StatusOr<store::ListResult> page = store_->ListKeys(prefix, 0, token);
    if (!page.ok()) return page.status();
    if (token.empty()) list.revision = page->revision;
    for (std::string& k : page->keys) list.keys.push_back(std::move(k));
    token = std::move(page->next_page_token);
  } while (!token.empty());
  return list;
}

absl::StatusOr<std::unique_ptr<WatchHandle>> InProcessStore::Watch(
    absl::string_view prefix, int64_t from_revision, WatchCallback callback) {
  auto watch =
      std::make_unique<InProcessWatch>(store_.get(), std::move(callback));
  InProcessWatch* raw = watch.get();
  absl::StatusOr<store::KvStore::WatchStart> start = store_->Watch(
      prefix, from_revision,
      [raw](std::vector<store::Event> events) { raw->Push(std::move(events)); },
      [raw](absl::Status status) { raw->Close(std::move(status)); });
  if (!start.ok()) return start.status();
  watch->Start(start->id);
  return watch;
}

}  // namespace cohort

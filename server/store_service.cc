#include "server/store_service.h"

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace cohort::server {
namespace {

using store::KvStore;
using store::ReadResult;

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* ctx,
                                 const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::StatusOr<absl::Duration> RequestTimeout(int64_t timeout_ms) {
  if (timeout_ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms must be >= 0 (0 means the default of ",
                     absl::FormatDuration(store::kDefaultTimeout), "), got ",
                     timeout_ms));
  }
  if (timeout_ms == 0) return store::kDefaultTimeout;
  return absl::Milliseconds(timeout_ms);
}

template <typename Repeated>
std::vector<std::string> ToVector(const Repeated& keys) {
  return std::vector<std::string>(keys.begin(), keys.end());
}

// A unary call that completes when a KvStore wait does. Exactly one of the
// wait's callback, OnCancel (client gone or gRPC deadline) and Shutdown gets
// to call Finish; the shared State outlives the reactor so a late callback
// never touches freed memory.
class WaitReactor final : public grpc::ServerUnaryReactor {
 public:
  using Fill = std::function<void(ReadResult&)>;

  explicit WaitReactor(KvStore* store)
      : store_(store), state_(std::make_shared<State>(this)) {}

  void Start(std::vector<std::string> keys, bool read_values,
             absl::Duration timeout, Fill fill) {
    id_ = store_->WaitForKeys(
        std::move(keys), read_values, timeout,
        [state = state_, fill = std::move(fill)](absl::StatusOr<ReadResult> r) {
          if (state->finished.exchange(true)) return;
          if (r.ok()) fill(*r);
          state->reactor->Finish(ToGrpcStatus(r.status()));
        });
  }

  void OnCancel() override {
    store_->CancelWait(id_);
    if (!state_->finished.exchange(true)) Finish(grpc::Status::CANCELLED);
  }

  void OnDone() override { delete this; }

 private:
  struct State {
    explicit State(WaitReactor* r) : reactor(r) {}
    WaitReactor* const reactor;
    std::atomic<bool> finished{false};
  };

  KvStore* const store_;
  std::shared_ptr<State> state_;
  std::atomic<KvStore::WaitId> id_{0};
};

// Streams KvStore watch events. Events queue in `pending` and are written
// one at a time; the queue is bounded, and a client that falls behind is
// ended with RESOURCE_EXHAUSTED rather than growing the server's memory.
class WatchReactor final : public grpc::ServerWriteReactor<v1::WatchResponse> {
 public:
  WatchReactor(KvStore* store, size_t buffer_bytes)
      : store_(store),
        state_(std::make_shared<State>(this, buffer_bytes)) {}

  void Start(const v1::WatchRequest& req) {
    auto on_events = [state = state_](std::vector<store::Event> events) {
      state->Push(std::move(events));
    };
    auto on_close = [state = state_](absl::Status status) {
      state->Close(ToGrpcStatus(status));
    };
    absl::StatusOr<KvStore::WatchStart> start =
        store_->Watch(req.prefix(), req.from_revision(), on_events, on_close);
    if (!start.ok()) {
      state_->Close(ToGrpcStatus(start.status()));
      return;
    }
    id_ = start->id;
    v1::WatchResponse first;
    first.set_start_revision(start->start_revision);
    state_->Begin(std::move(first));
  }

  void OnWriteDone(bool ok) override { state_->WriteDone(ok); }

  void OnCancel() override {
    store_->CancelWatch(id_);
    state_->Close(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    store_->CancelWatch(id_);
    delete this;
  }

 private:
  class State {
   public:
    State(WatchReactor* reactor, size_t limit)
        : reactor_(reactor), limit_(limit) {}

    // Queues events (replayed ones arrive before Begin).
    void Push(std::vector<store::Event> events) {
      // Keep messages to a few MiB so one slow write does not stall others.
      constexpr size_t kMaxMessageBytes = 4 << 20;
      Action action;
      {
        absl::MutexLock lock(&mu_);
        if (closing_) return;
        v1::WatchResponse* msg = nullptr;
        size_t msg_bytes = 0;
        for (store::Event& e : events) {
          if (msg == nullptr || msg_bytes > kMaxMessageBytes) {
            pending_.emplace_back();
            msg = &pending_.back();
            msg_bytes = 0;
          }
          v1::Event* out = msg->add_events();
          out->set_type(e.type == store::Event::Type::kPut
                            ? v1::Event::PUT
                            : v1::Event::DELETE);
          out->set_key(std::move(e.key));
          if (e.value) out->set_value(*e.value);
          out->set_revision(e.revision);
          msg_bytes += Bytes(*out);
        }
        pending_bytes_ += msg_bytes;
        if (pending_bytes_ > limit_) {
          // Drop what is queued but not the message being written.
          while (pending_.size() > (writing_ ? 1u : 0u)) pending_.pop_back();
          pending_bytes_ = 0;
          CloseLocked(grpc::Status(
              grpc::StatusCode::RESOURCE_EXHAUSTED,
              absl::StrCat("watch fell more than ", limit_,
                           " bytes behind; resume from the last revision "
                           "received")));
        }
        action = NextLocked();
      }
      Run(action);
    }

    // Sends `first` ahead of anything queued, then starts streaming.
    void Begin(v1::WatchResponse first) {
      Action action;
      {
        absl::MutexLock lock(&mu_);
        pending_.push_front(std::move(first));
        started_ = true;
        action = NextLocked();
      }
      Run(action);
    }

    void WriteDone(bool ok) {
      Action action;
      {
        absl::MutexLock lock(&mu_);
        writing_ = false;
        if (!pending_.empty()) {
          size_t bytes = 0;
          for (const v1::Event& e : pending_.front().events()) bytes += Bytes(e);
          pending_bytes_ -= std::min(pending_bytes_, bytes);
          pending_.pop_front();
        }
        // A failed write means the client went away.
        if (!ok) CloseLocked(grpc::Status::CANCELLED);
        action = NextLocked();
      }
      Run(action);
    }

    void Close(grpc::Status status) {
      Action action;
      {
        absl::MutexLock lock(&mu_);
        CloseLocked(std::move(status));
        started_ = true;
        action = NextLocked();
      }
      Run(action);
    }

   private:
    // What to call on the reactor once mu_ is released: gRPC may run a
    // reaction inline, and a reaction takes mu_.
    struct Action {
      const v1::WatchResponse* write = nullptr;
      std::optional<grpc::Status> finish;
    };

    static size_t Bytes(const v1::Event& e) {
      return e.key().size() + e.value().size() + 16;
    }

    void CloseLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (closing_) return;
      closing_ = true;
      close_status_ = std::move(status);
      while (pending_.size() > (writing_ ? 1u : 0u)) pending_.pop_back();
    }

    Action NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      Action action;
      if (!started_ || writing_ || finished_) return action;
      if (closing_) {
        finished_ = true;
        action.finish = close_status_;
      } else if (!pending_.empty()) {
        writing_ = true;
        action.write = &pending_.front();
      }
      return action;
    }

    void Run(const Action& action) {
      if (action.write != nullptr) reactor_->StartWrite(action.write);
      if (action.finish) reactor_->Finish(*action.finish);
    }

    WatchReactor* const reactor_;
    const size_t limit_;
    absl::Mutex mu_;
    std::deque<v1::WatchResponse> pending_ ABSL_GUARDED_BY(mu_);
    size_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
    bool started_ ABSL_GUARDED_BY(mu_) = false;
    bool writing_ ABSL_GUARDED_BY(mu_) = false;
    bool closing_ ABSL_GUARDED_BY(mu_) = false;
    bool finished_ ABSL_GUARDED_BY(mu_) = false;
    grpc::Status close_status_ ABSL_GUARDED_BY(mu_);
  };

  KvStore* const store_;
  std::shared_ptr<State> state_;
  std::atomic<KvStore::WatchId> id_{0};
};

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

StoreService::StoreService(store::KvStore* store, StoreServiceOptions options)
    : store_(store), options_(options) {}

grpc::ServerUnaryReactor* StoreService::Set(grpc::CallbackServerContext* ctx,
                                            const v1::SetRequest* req,
                                            v1::SetResponse* resp) {
  absl::StatusOr<int64_t> r = store_->Set(req->key(), req->value());
  if (r.ok()) resp->set_revision(*r);
  return Finish(ctx, r.status());
}

grpc::ServerUnaryReactor* StoreService::Get(grpc::CallbackServerContext* ctx,
                                            const v1::GetRequest* req,
                                            v1::GetResponse* resp) {
  absl::StatusOr<absl::Duration> timeout = RequestTimeout(req->timeout_ms());
  if (!timeout.ok()) return Finish(ctx, timeout.status());
  auto* reactor = new WaitReactor(store_);
  reactor->Start({req->key()}, /*read_values=*/true, *timeout,
                 [resp](ReadResult& r) {
                   resp->set_value(std::move(r.values[0]));
                   resp->set_revision(r.revision);
                 });
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::Add(grpc::CallbackServerContext* ctx,
                                            const v1::AddRequest* req,
                                            v1::AddResponse* resp) {
  absl::StatusOr<store::AddResult> r = store_->Add(req->key(), req->delta());
  if (r.ok()) {
    resp->set_value(r->value);
    resp->set_revision(r->revision);
  }
  return Finish(ctx, r.status());
}

grpc::ServerUnaryReactor* StoreService::CompareSet(
    grpc::CallbackServerContext* ctx, const v1::CompareSetRequest* req,
    v1::CompareSetResponse* resp) {
  absl::StatusOr<store::CompareSetResult> r =
      store_->CompareSet(req->key(), req->expected(), req->desired());
  if (r.ok()) {
    resp->set_value(std::move(r->value));
    resp->set_swapped(r->swapped);
    resp->set_revision(r->revision);
  }
  return Finish(ctx, r.status());
}

grpc::ServerUnaryReactor* StoreService::Wait(grpc::CallbackServerContext* ctx,
                                             const v1::WaitRequest* req,
                                             v1::WaitResponse* resp) {
  absl::StatusOr<absl::Duration> timeout = RequestTimeout(req->timeout_ms());
  if (!timeout.ok()) return Finish(ctx, timeout.status());
  auto* reactor = new WaitReactor(store_);
  reactor->Start(ToVector(req->keys()), /*read_values=*/false, *timeout,
                 [resp](ReadResult& r) { resp->set_revision(r.revision); });
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::Check(grpc::CallbackServerContext* ctx,
                                              const v1::CheckRequest* req,
                                              v1::CheckResponse* resp) {
  absl::StatusOr<store::CheckResult> r = store_->Check(ToVector(req->keys()));
  if (r.ok()) {
    resp->set_all_exist(r->all_exist);
    resp->set_revision(r->revision);
  }
  return Finish(ctx, r.status());
}

grpc::ServerUnaryReactor* StoreService::Delete(grpc::CallbackServerContext* ctx,
                                               const v1::DeleteRequest* req,
                                               v1::DeleteResponse* resp) {
  absl::StatusOr<store::DeleteResult> r = store_->Delete(req->key());
  if (r.ok()) {
    resp->set_deleted(r->deleted);
    resp->set_revision(r->revision);
  }
  return Finish(ctx, r.status());
}

grpc::ServerUnaryReactor* StoreService::NumKeys(
    grpc::CallbackServerContext* ctx, const v1::NumKeysRequest*,
    v1::NumKeysResponse* resp) {
  absl::StatusOr<store::NumKeysResult> r = store_->NumKeys();
  if (r.ok()) {
    resp->set_num_keys(r->num_keys);
    resp->set_revision(r->revision);
  }
  return Finish(ctx, r.status());
}

grpc::ServerUnaryReactor* StoreService::MultiGet(
    grpc::CallbackServerContext* ctx, const v1::MultiGetRequest* req,
    v1::MultiGetResponse* resp) {
  absl::StatusOr<absl::Duration> timeout = RequestTimeout(req->timeout_ms());
  if (!timeout.ok()) return Finish(ctx, timeout.status());
  auto* reactor = new WaitReactor(store_);
  reactor->Start(ToVector(req->keys()), /*read_values=*/true, *timeout,
                 [resp](ReadResult& r) {
                   for (std::string& v : r.values) {
                     resp->add_values(std::move(v));
                   }
                   resp->set_revision(r.revision);
                 });
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::MultiSet(
    grpc::CallbackServerContext* ctx, const v1::MultiSetRequest* req,
    v1::MultiSetResponse* resp) {
  absl::StatusOr<int64_t> r = store_->MultiSet(ToVector(req->keys()),
                                               ToVector(req->values()));
  if (r.ok()) resp->set_revision(*r);
  return Finish(ctx, r.status());
}

grpc::ServerUnaryReactor* StoreService::Append(grpc::CallbackServerContext* ctx,
                                               const v1::AppendRequest* req,
                                               v1::AppendResponse* resp) {
  absl::StatusOr<int64_t> r = store_->Append(req->key(), req->value());
  if (r.ok()) resp->set_revision(*r);
  return Finish(ctx, r.status());
}

grpc::ServerUnaryReactor* StoreService::ListKeys(
    grpc::CallbackServerContext* ctx, const v1::ListKeysRequest* req,
    v1::ListKeysResponse* resp) {
  if (req->page_size() < 0) {
    return Finish(ctx, absl::InvalidArgumentError(absl::StrCat(
                           "page_size must be >= 0, got ", req->page_size())));
  }
  absl::StatusOr<store::ListResult> r =
      store_->ListKeys(req->prefix(), req->page_size(), req->page_token());
  if (r.ok()) {
    for (std::string& k : r->keys) resp->add_keys(std::move(k));
    resp->set_next_page_token(std::move(r->next_page_token));
    resp->set_revision(r->revision);
  }
  return Finish(ctx, r.status());
}

grpc::ServerWriteReactor<v1::WatchResponse>* StoreService::Watch(
    grpc::CallbackServerContext*, const v1::WatchRequest* req) {
  auto* reactor = new WatchReactor(store_, options_.watch_buffer_bytes);
  reactor->Start(*req);
  return reactor;
}

}  // namespace cohort::server

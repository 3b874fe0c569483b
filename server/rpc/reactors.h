// Reactors shared by cohortd's services: a unary call completed later by a
// callback (blocking calls), and a server stream fed by KvStore watch
// events. Both hold no thread while they wait.
#ifndef COHORT_SERVER_RPC_REACTORS_H_
#define COHORT_SERVER_RPC_REACTORS_H_

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"
#include "proto/rpc/grpc_status.h"
#include "server/auth/auth.h"
#include "server/auth/quota.h"
#include "store/kv_store.h"

namespace cohort::server {

using base::ToGrpcStatus;

// Finishes a unary call at once with `status` (the non-blocking RPCs).
inline grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx,
                                           const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// A unary call finished later, by whichever comes first: a completion
// (Handle::Claim, then fill the response, then Handle::Finish) or the client
// going away (OnCancel runs the cancel hook, e.g. to forget a waiter). The
// Handle may outlive the reactor: after the call ended, Claim returns false.
class PendingUnary final : public grpc::ServerUnaryReactor {
 public:
  class Handle {
   public:
    // True exactly once, for the winner; the winner may then write the
    // response and must call Finish.
    bool Claim() const { return !state_->claimed.exchange(true); }
    void Finish(const absl::Status& status) const {
      // Given back before the reply, so that a client that saw its call
      // end may start another at once.
      state_->reactor->charge_.Release();
      state_->reactor->Finish(ToGrpcStatus(status));
    }

   private:
    friend class PendingUnary;
    struct State {
      PendingUnary* reactor;
      std::atomic<bool> claimed{false};
    };
    std::shared_ptr<State> state_;
  };

  PendingUnary() {
    handle_.state_ = std::make_shared<Handle::State>();
    handle_.state_->reactor = this;
  }

  const Handle& handle() const { return handle_; }

  // Runs on cancellation (client gone, gRPC deadline). Set once the wait is
  // registered.
  void SetCancelHook(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    cancel_hook_ = std::move(hook);
  }

  void OnCancel() override {
    std::function<void()> hook;
    {
      absl::MutexLock lock(&mu_);
      hook = std::move(cancel_hook_);
    }
    if (hook) hook();
    if (handle_.Claim()) handle_.Finish(absl::CancelledError("call cancelled"));
  }

  // Runs once the call is over, however it ended (e.g. to stop watching
  // its token: Authenticator::ForgetGrant). Set before the handler returns.
  void SetDoneHook(std::function<void()> hook) { done_hook_ = std::move(hook); }

  void OnDone() override {
    if (done_hook_) done_hook_();
    delete this;
  }

  // Holds `charge` until the call ends, however it ends.
  void Hold(QuotaCharge charge) { charge_ = std::move(charge); }

 private:
  Handle handle_;
  QuotaCharge charge_;
  std::function<void()> done_hook_;
  absl::Mutex mu_;
  std::function<void()> cancel_hook_ ABSL_GUARDED_BY(mu_);
};

// Counts of the watch streams (EventStream) of a server, for monitoring.
struct WatchGauges {
  std::atomic<int64_t> streams{0};         // Open now.
  std::atomic<int64_t> buffered_bytes{0};  // Queued, not yet written.
};

// Streams KvStore watch events as `Response` messages (which have
// `start_revision` and repeated events). `append` adds one store event to a
// message, returning its size in bytes, or 0 to skip it. Events queue and
// are written one at a time; a client that falls more than `buffer_bytes`
// behind is ended with RESOURCE_EXHAUSTED rather than growing the server's
// memory. `gauges`, when not null, counts the stream and its queued bytes
// and must outlive it.
template <typename Response>
class EventStream final : public grpc::ServerWriteReactor<Response> {
 public:
  using Append = std::function<size_t(store::Event&, Response&)>;

  EventStream(store::KvStore* store, size_t buffer_bytes, Append append,
              WatchGauges* gauges = nullptr)
      : store_(store),
        state_(std::make_shared<State>(this, buffer_bytes, std::move(append),
                                       gauges)) {}

  // Registers the KvStore watch and sends the first message.
  void Start(const std::string& prefix, int64_t from_revision) {
    auto on_events = [state = state_](std::vector<store::Event> events) {
      state->Push(std::move(events));
    };
    auto on_close = [state = state_](absl::Status status) {
      state->Close(ToGrpcStatus(status));
    };
    absl::StatusOr<store::KvStore::WatchStart> start =
        store_->Watch(prefix, from_revision, on_events, on_close);
    if (!start.ok()) {
      state_->Close(ToGrpcStatus(start.status()));
      return;
    }
    id_ = start->id;
    Response first;
    first.set_start_revision(start->start_revision);
    state_->Begin(std::move(first));
  }

  // Ends the stream before it starts (a refused request).
  void Fail(const absl::Status& status) { state_->Close(ToGrpcStatus(status)); }

  // Ends the stream with a status, from any thread, at once: what is
  // queued is dropped. Usable after the stream is over (then it does
  // nothing), so it may be handed to whoever learns that the stream must
  // end (Authenticator::WatchGrant).
  std::function<void(absl::Status)> Ender() const {
    return [state = std::weak_ptr<State>(state_)](absl::Status status) {
      if (std::shared_ptr<State> s = state.lock()) {
        s->Close(ToGrpcStatus(status));
      }
    };
  }

  // `check` is asked before each message is sent; a non-OK status ends the
  // stream with it instead (a token that expired). It runs under the
  // stream's lock and may run under the store's: it must be cheap and must
  // not call into the store. Call before Start.
  void SetWriteCheck(std::function<absl::Status()> check) {
    state_->SetWriteCheck(std::move(check));
  }

  // As PendingUnary::SetDoneHook.
  void SetDoneHook(std::function<void()> hook) { done_hook_ = std::move(hook); }

  // Holds `charge` until the stream ends, however it ends. Call before
  // Start.
  void Hold(QuotaCharge charge) { charge_ = std::move(charge); }

  void OnWriteDone(bool ok) override { state_->WriteDone(ok); }

  void OnCancel() override {
    store_->CancelWatch(id_);
    state_->Close(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    store_->CancelWatch(id_);
    if (done_hook_) done_hook_();
    delete this;
  }

 private:
  class State {
   public:
    State(EventStream* reactor, size_t limit, Append append,
          WatchGauges* gauges)
        : reactor_(reactor),
          limit_(limit),
          append_(std::move(append)),
          gauges_(gauges) {
      if (gauges_ != nullptr) ++gauges_->streams;
    }

    // The stream's last reference goes with the reactor or, later, with the
    // store's watch callbacks.
    ~State() {
      if (gauges_ == nullptr) return;
      --gauges_->streams;
      gauges_->buffered_bytes -= static_cast<int64_t>(pending_bytes_);
    }

    void SetWriteCheck(std::function<absl::Status()> check) {
      absl::MutexLock lock(&mu_);
      check_ = std::move(check);
    }

    // Queues events (replayed ones arrive before Begin).
    void Push(std::vector<store::Event> events) {
      // Keep messages to a few MiB so one slow write does not stall others.
      constexpr size_t kMaxMessageBytes = 4 << 20;
      Action action;
      {
        absl::MutexLock lock(&mu_);
        if (closing_) return;
        for (store::Event& e : events) {
          if (pending_.size() <= (writing_ ? 1u : 0u) ||
              tail_bytes_ > kMaxMessageBytes) {
            pending_.emplace_back();
            sizes_.push_back(0);
            tail_bytes_ = 0;
          }
          const size_t bytes = append_(e, pending_.back());
          tail_bytes_ += bytes;
          sizes_.back() += bytes;
          AddPendingLocked(static_cast<int64_t>(bytes));
        }
        if (pending_bytes_ > limit_) {
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
    void Begin(Response first) {
      Action action;
      {
        absl::MutexLock lock(&mu_);
        pending_.push_front(std::move(first));
        sizes_.push_front(0);
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
          AddPendingLocked(
              -static_cast<int64_t>(std::min(pending_bytes_, sizes_.front())));
          pending_.pop_front();
          sizes_.pop_front();
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
    // reaction inline, and reactions take mu_.
    struct Action {
      const Response* write = nullptr;
      std::optional<grpc::Status> finish;
    };

    void CloseLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (closing_) return;
      closing_ = true;
      close_status_ = std::move(status);
      // Drop what is queued, but not the message being written.
      while (pending_.size() > (writing_ ? 1u : 0u)) {
        AddPendingLocked(
            -static_cast<int64_t>(std::min(pending_bytes_, sizes_.back())));
        pending_.pop_back();
        sizes_.pop_back();
      }
    }

    void AddPendingLocked(int64_t delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      pending_bytes_ =
          static_cast<size_t>(static_cast<int64_t>(pending_bytes_) + delta);
      if (gauges_ != nullptr) gauges_->buffered_bytes += delta;
    }

    Action NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      Action action;
      if (!started_ || writing_ || finished_) return action;
      if (!closing_ && !pending_.empty() && check_) {
        if (absl::Status s = check_(); !s.ok()) CloseLocked(ToGrpcStatus(s));
      }
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
      if (action.finish) {
        // As PendingUnary::Handle::Finish. Only one Run finishes.
        reactor_->charge_.Release();
        reactor_->Finish(*action.finish);
      }
    }

    EventStream* const reactor_;
    const size_t limit_;
    const Append append_;
    WatchGauges* const gauges_;
    absl::Mutex mu_;
    std::deque<Response> pending_ ABSL_GUARDED_BY(mu_);
    std::deque<size_t> sizes_ ABSL_GUARDED_BY(mu_);  // Bytes of each message.
    size_t tail_bytes_ ABSL_GUARDED_BY(mu_) = 0;
    size_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
    bool started_ ABSL_GUARDED_BY(mu_) = false;
    bool writing_ ABSL_GUARDED_BY(mu_) = false;
    bool closing_ ABSL_GUARDED_BY(mu_) = false;
    bool finished_ ABSL_GUARDED_BY(mu_) = false;
    grpc::Status close_status_ ABSL_GUARDED_BY(mu_);
    std::function<absl::Status()> check_ ABSL_GUARDED_BY(mu_);
  };

  store::KvStore* const store_;
  std::shared_ptr<State> state_;
  std::atomic<store::KvStore::WatchId> id_{0};
  QuotaCharge charge_;
  std::function<void()> done_hook_;
};

// The checks of auth.h and quota.h for calls that hold something until they
// end; shared by the store and membership services.

// Charges the tenant behind `grant` (unused with auth off, `auth` null)
// for what a call holds: nothing without quotas or for an admin.
inline absl::StatusOr<QuotaCharge> ChargeCall(
    Quotas* quotas, Authenticator* auth, const Grant& grant,
    const grpc::CallbackServerContext& ctx,
    std::initializer_list<std::pair<Quota, uint64_t>> amounts) {
  if (quotas == nullptr) return QuotaCharge();
  return quotas->Charge(
      QuotaOwner(auth == nullptr ? nullptr : &grant, ctx.peer()), amounts);
}

// Ends `stream` with UNAUTHENTICATED once `grant` stops holding: at once
// when it is revoked, before its next message once it expired.
template <typename Response>
absl::Status EndWithGrant(Authenticator* auth, const Grant& grant,
                          EventStream<Response>& stream) {
  if (auth == nullptr) return absl::OkStatus();
  absl::StatusOr<Authenticator::GrantWatchId> watch =
      auth->WatchGrant(grant, stream.Ender());
  if (!watch.ok()) return watch.status();
  stream.SetWriteCheck([auth, grant] { return auth->CheckExpiry(grant); });
  stream.SetDoneHook([auth, id = *watch] { auth->ForgetGrant(id); });
  return absl::OkStatus();
}

}  // namespace cohort::server

#endif  // COHORT_SERVER_RPC_REACTORS_H_

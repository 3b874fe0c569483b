#include "client/remote_store.h"

#include <algorithm>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/create_channel.h"

namespace cohort {
namespace {

// Slack given to a blocking call's gRPC deadline beyond the timeout the
// server enforces, so that the server's message (naming the missing keys)
// arrives before the client gives up on its own.
constexpr absl::Duration kServerTimeoutSlack = absl::Seconds(5);

absl::StatusCode ToAbslCode(grpc::StatusCode code) {
  return static_cast<absl::StatusCode>(code);
}

int64_t ToMillis(absl::Duration d) {
  // 0 would mean "server default"; ask for at least 1 ms.
  return std::max<int64_t>(1, absl::ToInt64Milliseconds(d));
}

absl::Duration Jittered(absl::Duration d) {
  thread_local std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<double> dist(0.5, 1.0);
  return d * dist(rng);
}

template <typename Repeated>
void CopyKeys(absl::Span<const std::string> keys, Repeated* out) {
  out->Reserve(keys.size());
  for (const std::string& k : keys) out->Add(std::string(k));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RemoteStore>> RemoteStore::Connect(
    const RemoteStoreOptions& options) {
  if (options.address.empty() ||
      options.address.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cohortd address must be HOST:PORT, got '", options.address, "'"));
  }
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError("max_attempts must be >= 1");
  }
  return std::unique_ptr<RemoteStore>(new RemoteStore(options));
}

RemoteStore::RemoteStore(const RemoteStoreOptions& options)
    : options_(options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // Each RemoteStore gets a connection of its own rather than sharing one
  // with every other channel to the same address in the process.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Reconnect quickly after a cohortd restart.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  channel_ = grpc::CreateCustomChannel(
      options.address, grpc::InsecureChannelCredentials(), args);
  stub_ = v1::Store::NewStub(channel_);
}

absl::Status RemoteStore::WaitConnected() {
  if (channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) {
    return absl::OkStatus();
  }
  if (channel_->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options_.connect_timeout))) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(
      absl::StrCat("cannot connect to cohortd at ", options_.address,
                   " within ", absl::FormatDuration(options_.connect_timeout),
                   ": is it running there? (set --addr or COHORT_ADDR)"));
}

absl::Status RemoteStore::Explain(absl::string_view what,
                                  const grpc::Status& status,
                                  int attempts) const {
  std::string message = status.error_message();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    message = absl::StrCat("cohortd at ", options_.address,
                           " is unavailable (", attempts,
                           attempts == 1 ? " attempt" : " attempts",
                           "): ", message);
  } else if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
             message == "Deadline Exceeded") {
    message = absl::StrCat("no answer from cohortd at ", options_.address,
                           " before the call's deadline");
  }
  return absl::Status(ToAbslCode(status.error_code()),
                      absl::StrCat(what, ": ", message));
}

template <typename Request, typename Response>
absl::Status RemoteStore::Call(
    absl::string_view what, bool retryable, absl::Duration deadline,
    grpc::Status (v1::Store::Stub::*method)(grpc::ClientContext*,
                                            const Request&, Response*),
    const Request& request, Response* response) {
  absl::Duration backoff = options_.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    // Waiting for the connection already spent connect_timeout: final.
    if (absl::Status connected = WaitConnected(); !connected.ok()) {
      return absl::UnavailableError(
          absl::StrCat(what, ": ", connected.message()));
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    grpc::Status status = (stub_.get()->*method)(&context, request, response);
    if (status.ok()) return absl::OkStatus();
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE || !retryable ||
        attempt >= options_.max_attempts) {
      return Explain(what, status, attempt);
    }
    absl::SleepFor(Jittered(backoff));
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

absl::Status RemoteStore::Set(absl::string_view key, absl::string_view value) {
  v1::SetRequest req;
  req.set_key(std::string(key));
  req.set_value(std::string(value));
  v1::SetResponse resp;
  return Call("set", true, options_.rpc_timeout, &v1::Store::Stub::Set, req,
              &resp);
}

absl::StatusOr<std::string> RemoteStore::Get(absl::string_view key,
                                             absl::Duration timeout) {
  v1::GetRequest req;
  req.set_key(std::string(key));
  req.set_timeout_ms(ToMillis(timeout));
  v1::GetResponse resp;
  if (absl::Status s = Call("get", true, timeout + kServerTimeoutSlack,
                            &v1::Store::Stub::Get, req, &resp);
      !s.ok()) {
    return s;
  }
  return std::move(*resp.mutable_value());
}

absl::StatusOr<int64_t> RemoteStore::Add(absl::string_view key,
                                         int64_t delta) {
  v1::AddRequest req;
  req.set_key(std::string(key));
  req.set_delta(delta);
  v1::AddResponse resp;
  if (absl::Status s = Call("add", false, options_.rpc_timeout,
                            &v1::Store::Stub::Add, req, &resp);
      !s.ok()) {
    return s;
  }
  return resp.value();
}

absl::StatusOr<std::string> RemoteStore::CompareSet(absl::string_view key,
                                                    absl::string_view expected,
                                                    absl::string_view desired) {
  v1::CompareSetRequest req;
  req.set_key(std::string(key));
  req.set_expected(std::string(expected));
  req.set_desired(std::string(desired));
  v1::CompareSetResponse resp;
  if (absl::Status s = Call("compare_set", false, options_.rpc_timeout,
                            &v1::Store::Stub::CompareSet, req, &resp);
      !s.ok()) {
    return s;
  }
  return std::move(*resp.mutable_value());
}

absl::Status RemoteStore::Wait(absl::Span<const std::string> keys,
                               absl::Duration timeout) {
  v1::WaitRequest req;
  CopyKeys(keys, req.mutable_keys());
  req.set_timeout_ms(ToMillis(timeout));
  v1::WaitResponse resp;
  return Call("wait", true, timeout + kServerTimeoutSlack,
              &v1::Store::Stub::Wait, req, &resp);
}

absl::StatusOr<bool> RemoteStore::Check(absl::Span<const std::string> keys) {
  v1::CheckRequest req;
  CopyKeys(keys, req.mutable_keys());
  v1::CheckResponse resp;
  if (absl::Status s = Call("check", true, options_.rpc_timeout,
                            &v1::Store::Stub::Check, req, &resp);
      !s.ok()) {
    return s;
  }
  return resp.all_exist();
}

absl::StatusOr<bool> RemoteStore::DeleteKey(absl::string_view key) {
  v1::DeleteRequest req;
  req.set_key(std::string(key));
  v1::DeleteResponse resp;
  // Repeating a delete is harmless, but a retry that follows an applied
  // attempt reports false; callers that care use the revision-free answer
  // of the first attempt, so deletes are not retried.
  if (absl::Status s = Call("delete", false, options_.rpc_timeout,
                            &v1::Store::Stub::Delete, req, &resp);
      !s.ok()) {
    return s;
  }
  return resp.deleted();
}

absl::StatusOr<int64_t> RemoteStore::NumKeys() {
  v1::NumKeysRequest req;
  v1::NumKeysResponse resp;
  if (absl::Status s = Call("num_keys", true, options_.rpc_timeout,
                            &v1::Store::Stub::NumKeys, req, &resp);
      !s.ok()) {
    return s;
  }
  return resp.num_keys();
}

absl::StatusOr<std::vector<std::string>> RemoteStore::MultiGet(
    absl::Span<const std::string> keys, absl::Duration timeout) {
  v1::MultiGetRequest req;
  CopyKeys(keys, req.mutable_keys());
  req.set_timeout_ms(ToMillis(timeout));
  v1::MultiGetResponse resp;
  if (absl::Status s = Call("multi_get", true, timeout + kServerTimeoutSlack,
                            &v1::Store::Stub::MultiGet, req, &resp);
      !s.ok()) {
    return s;
  }
  std::vector<std::string> values;
  values.reserve(resp.values_size());
  for (std::string& v : *resp.mutable_values()) values.push_back(std::move(v));
  return values;
}

absl::Status RemoteStore::MultiSet(absl::Span<const std::string> keys,
                                   absl::Span<const std::string> values) {
  v1::MultiSetRequest req;
  CopyKeys(keys, req.mutable_keys());
  CopyKeys(values, req.mutable_values());
  v1::MultiSetResponse resp;
  return Call("multi_set", true, options_.rpc_timeout,
              &v1::Store::Stub::MultiSet, req, &resp);
}

absl::Status RemoteStore::Append(absl::string_view key,
                                 absl::string_view value) {
  v1::AppendRequest req;
  req.set_key(std::string(key));
  req.set_value(std::string(value));
  v1::AppendResponse resp;
  return Call("append", false, options_.rpc_timeout, &v1::Store::Stub::Append,
              req, &resp);
}

absl::StatusOr<KeyList> RemoteStore::ListKeys(absl::string_view prefix) {
  KeyList list;
  v1::ListKeysRequest req;
  req.set_prefix(std::string(prefix));
  do {
    v1::ListKeysResponse resp;
    if (absl::Status s = Call("list_keys", true, options_.rpc_timeout,
                              &v1::Store::Stub::ListKeys, req, &resp);
        !s.ok()) {
      return s;
    }
    if (req.page_token().empty()) list.revision = resp.revision();
    for (std::string& k : *resp.mutable_keys()) list.keys.push_back(std::move(k));
    req.set_page_token(std::move(*resp.mutable_next_page_token()));
  } while (!req.page_token().empty());
  return list;
}

// Reads the Watch stream on a thread of its own, calling the user's callback
// for each event, and reopens the stream from the next revision when cohortd
// becomes unavailable (e.g. restarts).
class RemoteStore::RemoteWatch final : public WatchHandle {
 public:
  RemoteWatch(RemoteStore* store, std::string prefix, int64_t from_revision,
              WatchCallback callback)
      : store_(store),
        prefix_(std::move(prefix)),
        next_revision_(from_revision),
        callback_(std::move(callback)),
        thread_([this] { Run(); }) {}

  ~RemoteWatch() override { Cancel(); }

  void Cancel() override {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      if (context_ != nullptr) context_->TryCancel();
    }
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
      thread_.join();
    }
  }

  absl::Status Wait() override {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&ended_));
    return status_;
  }

  // Blocks until cohortd has registered the watch (its first message) or the
  // watch has ended; returns the error it ended with, if any.
  absl::Status WaitStarted() {
    absl::MutexLock lock(&mu_);
    auto started_or_ended = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return started_ || ended_;
    };
    mu_.Await(absl::Condition(&started_or_ended));
    return started_ ? absl::OkStatus() : status_;
  }

 private:
  void Run() {
    absl::Duration backoff = store_->options_.initial_backoff;
    // A watch outlives restarts of cohortd: it gives up only after going
    // connect_timeout without a working stream.
    absl::Time last_ok = absl::Now();
    int attempts = 0;
    absl::Status status;
    for (;;) {
      grpc::ClientContext context;
      {
        absl::MutexLock lock(&mu_);
        if (cancelled_) break;
        context_ = &context;
      }
      ++attempts;
      v1::WatchRequest req;
      req.set_prefix(prefix_);
      req.set_from_revision(next_revision_);
      std::unique_ptr<grpc::ClientReader<v1::WatchResponse>> reader =
          store_->stub_->Watch(&context, req);
      v1::WatchResponse resp;
      while (reader->Read(&resp)) {
        last_ok = absl::Now();
        attempts = 0;
        backoff = store_->options_.initial_backoff;
        if (next_revision_ == 0) next_revision_ = resp.start_revision();
        if (resp.start_revision() > 0) {
          // The first message: cohortd has registered the watch.
          absl::MutexLock lock(&mu_);
          started_ = true;
        }
        for (const v1::Event& e : resp.events()) {
          WatchEvent event;
          event.type = e.type() == v1::Event::DELETE ? WatchEvent::Type::kDelete
                                                     : WatchEvent::Type::kPut;
          event.key = e.key();
          event.value = e.value();
          event.revision = e.revision();
          callback_(event);
          next_revision_ = e.revision() + 1;
        }
      }
      grpc::Status finished = reader->Finish();
      {
        absl::MutexLock lock(&mu_);
        context_ = nullptr;
        if (cancelled_) break;
      }
      if (finished.error_code() != grpc::StatusCode::UNAVAILABLE ||
          absl::Now() - last_ok > store_->options_.connect_timeout) {
        status = store_->Explain("watch", finished, attempts);
        break;
      }
      // cohortd restarted or the connection broke: resume where we were.
      absl::SleepFor(Jittered(backoff));
      backoff = std::min(backoff * 2, store_->options_.max_backoff);
      store_->WaitConnected().IgnoreError();
    }
    absl::MutexLock lock(&mu_);
    status_ = status;
    ended_ = true;
  }

  RemoteStore* const store_;
  const std::string prefix_;
  int64_t next_revision_;  // Owned by the thread.
  const WatchCallback callback_;
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::thread thread_;  // Last: starts once the rest is built.
};

absl::StatusOr<std::unique_ptr<WatchHandle>> RemoteStore::Watch(
    absl::string_view prefix, int64_t from_revision, WatchCallback callback) {
  if (from_revision < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("watch: from_revision must be >= 0, got ", from_revision));
  }
  auto watch = std::make_unique<RemoteWatch>(
      this, std::string(prefix), from_revision, std::move(callback));
  if (absl::Status s = watch->WaitStarted(); !s.ok()) return s;
  return watch;
}

}  // namespace cohort

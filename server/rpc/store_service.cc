#include "server/rpc/store_service.h"

#include <functional>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/c10d/rules.h"
#include "server/rpc/reactors.h"

namespace cohort::server {
namespace {

using store::KvStore;
using store::ReadResult;

absl::StatusOr<absl::Duration> RequestTimeout(int64_t timeout_ms) {
  if (timeout_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "timeout_ms must be >= 0 (0 means the default of ",
        absl::FormatDuration(store::kDefaultTimeout), "), got ", timeout_ms));
  }
  if (timeout_ms == 0) return store::kDefaultTimeout;
  return absl::Milliseconds(timeout_ms);
}

template <typename Repeated>
std::vector<std::string> ToVector(const Repeated& keys) {
  return std::vector<std::string>(keys.begin(), keys.end());
}

// Starts a KvStore wait that completes `reactor`; `fill` writes the
// response from the keys' values. `charge` is held until the call ends.
// With auth on (`auth` not null) the call ends UNAUTHENTICATED instead,
// with no values, once `grant` stops holding: at once when it is revoked
// (WatchGrant), else when the wait completes (Recheck).
grpc::ServerUnaryReactor* WaitFor(KvStore* store, std::vector<std::string> keys,
                                  bool read_values, absl::Duration timeout,
                                  QuotaCharge charge, Authenticator* auth,
                                  const Grant& grant,
                                  std::function<void(ReadResult&)> fill) {
  auto* reactor = new PendingUnary();
  reactor->Hold(std::move(charge));
  PendingUnary::Handle handle = reactor->handle();
  Authenticator::GrantWatchId watch = 0;
  if (auth != nullptr) {
    absl::StatusOr<Authenticator::GrantWatchId> watched =
        auth->WatchGrant(grant, [handle](absl::Status why) {
          if (handle.Claim()) handle.Finish(why);
        });
    if (!watched.ok()) {
      handle.Claim();
      handle.Finish(watched.status());
      return reactor;
    }
    watch = *watched;
  }
  KvStore::WaitId id = store->WaitForKeys(
      std::move(keys), read_values, timeout,
      [handle, auth, grant,
       fill = std::move(fill)](absl::StatusOr<ReadResult> r) {
        if (!handle.Claim()) return;
        if (r.ok() && auth != nullptr) {
          if (absl::Status s = auth->Recheck(grant); !s.ok()) {
            return handle.Finish(s);
          }
        }
        if (r.ok()) fill(*r);
        handle.Finish(r.status());
      });
  if (id != 0) reactor->SetCancelHook([store, id] { store->CancelWait(id); });
  // A wait ended by a revocation is still registered: forget it too.
  reactor->SetDoneHook([store, id, auth, watch] {
    if (id != 0) store->CancelWait(id);
    if (auth != nullptr) auth->ForgetGrant(watch);
  });
  return reactor;
}

// Adds one store event to a Watch message; returns its size.
size_t AppendEvent(store::Event& e, v1::WatchResponse& msg) {
  v1::Event* out = msg.add_events();
  out->set_type(e.type == store::Event::Type::kPut ? v1::Event::PUT
                                                   : v1::Event::DELETE);
  out->set_key(std::move(e.key));
  if (e.value) out->set_value(*e.value);
  out->set_revision(e.revision);
  return out->key().size() + out->value().size() + 16;
}

// Every handler that writes: authorize the keys for writing, refuse
// cohortd's reserved names, then finish with what `call` (the store call,
// which fills the response) returns.
template <typename Call>
grpc::ServerUnaryReactor* Write(Authenticator* auth,
                                grpc::CallbackServerContext* ctx,
                                absl::Span<const std::string> keys,
                                Call&& call) {
  absl::Status allowed = AuthorizeCall(auth, *ctx, "key", keys, Access::kWrite);
  for (size_t i = 0; allowed.ok() && i < keys.size(); ++i) {
    allowed = c10d::CheckClientWrite(keys[i]);
  }
  if (!allowed.ok()) return FinishNow(ctx, allowed);
  return FinishNow(ctx, call());
}

// A read that blocks until every key exists (Get, Wait, MultiGet):
// authorize the keys for reading, charge the wait to its tenant, then
// WaitFor.
grpc::ServerUnaryReactor* BlockingRead(KvStore* store,
                                       const StoreServiceOptions& options,
                                       grpc::CallbackServerContext* ctx,
                                       std::vector<std::string> keys,
                                       int64_t timeout_ms, bool read_values,
                                       std::function<void(ReadResult&)> fill) {
  Grant grant;
  if (absl::Status s =
          AuthorizeCall(options.auth, *ctx, "key", keys, Access::kRead, &grant);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<absl::Duration> timeout = RequestTimeout(timeout_ms);
  if (!timeout.ok()) return FinishNow(ctx, timeout.status());
  absl::StatusOr<QuotaCharge> charge =
      ChargeCall(options.quotas, options.auth, grant, *ctx,
                 {{Quota::kWaits, 1},
                  {Quota::kWaitedKeys, static_cast<uint64_t>(keys.size())}});
  if (!charge.ok()) return FinishNow(ctx, charge.status());
  return WaitFor(store, std::move(keys), read_values, *timeout,
                 std::move(*charge), options.auth, grant, std::move(fill));
}

}  // namespace

StoreService::StoreService(store::KvStore* store, StoreServiceOptions options)
    : store_(store), options_(options) {}

grpc::ServerUnaryReactor* StoreService::Set(grpc::CallbackServerContext* ctx,
                                            const v1::SetRequest* req,
                                            v1::SetResponse* resp) {
  return Write(options_.auth, ctx, absl::MakeConstSpan(&req->key(), 1), [&] {
    absl::StatusOr<int64_t> r = store_->Set(req->key(), req->value());
    if (r.ok()) resp->set_revision(*r);
    return r.status();
  });
}

grpc::ServerUnaryReactor* StoreService::Get(grpc::CallbackServerContext* ctx,
                                            const v1::GetRequest* req,
                                            v1::GetResponse* resp) {
  return BlockingRead(store_, options_, ctx, {req->key()}, req->timeout_ms(),
                      /*read_values=*/true, [resp](ReadResult& r) {
                        resp->set_value(std::move(r.values[0]));
                        resp->set_revision(r.revision);
                      });
}

grpc::ServerUnaryReactor* StoreService::Add(grpc::CallbackServerContext* ctx,
                                            const v1::AddRequest* req,
                                            v1::AddResponse* resp) {
  return Write(options_.auth, ctx, absl::MakeConstSpan(&req->key(), 1), [&] {
    absl::StatusOr<store::AddResult> r = store_->Add(req->key(), req->delta());
    if (r.ok()) {
      resp->set_value(r->value);
      resp->set_revision(r->revision);
    }
    return r.status();
  });
}

grpc::ServerUnaryReactor* StoreService::CompareSet(
    grpc::CallbackServerContext* ctx, const v1::CompareSetRequest* req,
    v1::CompareSetResponse* resp) {
  return Write(options_.auth, ctx, absl::MakeConstSpan(&req->key(), 1), [&] {
    absl::StatusOr<store::CompareSetResult> r =
        store_->CompareSet(req->key(), req->expected(), req->desired());
    if (r.ok()) {
      resp->set_value(std::move(r->value));
      resp->set_swapped(r->swapped);
      resp->set_revision(r->revision);
    }
    return r.status();
  });
}

grpc::ServerUnaryReactor* StoreService::Wait(grpc::CallbackServerContext* ctx,
                                             const v1::WaitRequest* req,
                                             v1::WaitResponse* resp) {
  return BlockingRead(
      store_, options_, ctx, ToVector(req->keys()), req->timeout_ms(),
      /*read_values=*/false,
      [resp](ReadResult& r) { resp->set_revision(r.revision); });
}

grpc::ServerUnaryReactor* StoreService::Check(grpc::CallbackServerContext* ctx,
                                              const v1::CheckRequest* req,
                                              v1::CheckResponse* resp) {
  const std::vector<std::string> keys = ToVector(req->keys());
  if (absl::Status s =
          AuthorizeCall(options_.auth, *ctx, "key", keys, Access::kRead);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<store::CheckResult> r = store_->Check(keys);
  if (r.ok()) {
    resp->set_all_exist(r->all_exist);
    resp->set_revision(r->revision);
  }
  return FinishNow(ctx, r.status());
}

grpc::ServerUnaryReactor* StoreService::Delete(grpc::CallbackServerContext* ctx,
                                               const v1::DeleteRequest* req,
                                               v1::DeleteResponse* resp) {
  return Write(options_.auth, ctx, absl::MakeConstSpan(&req->key(), 1), [&] {
    absl::StatusOr<store::DeleteResult> r = store_->Delete(req->key());
    if (r.ok()) {
      resp->set_deleted(r->deleted);
      resp->set_revision(r->revision);
    }
    return r.status();
  });
}

grpc::ServerUnaryReactor* StoreService::NumKeys(
    grpc::CallbackServerContext* ctx, const v1::NumKeysRequest*,
    v1::NumKeysResponse* resp) {
  // With a job's token, the keys under its prefix.
  absl::StatusOr<std::string> prefix =
      AuthorizedPrefix(options_.auth, *ctx, "");
  if (!prefix.ok()) return FinishNow(ctx, prefix.status());
  absl::StatusOr<store::NumKeysResult> r = store_->NumKeys(*prefix);
  if (r.ok()) {
    resp->set_num_keys(r->num_keys);
    resp->set_revision(r->revision);
  }
  return FinishNow(ctx, r.status());
}

grpc::ServerUnaryReactor* StoreService::MultiGet(
    grpc::CallbackServerContext* ctx, const v1::MultiGetRequest* req,
    v1::MultiGetResponse* resp) {
  return BlockingRead(store_, options_, ctx, ToVector(req->keys()),
                      req->timeout_ms(), /*read_values=*/true,
                      [resp](ReadResult& r) {
                        for (std::string& v : r.values) {
                          resp->add_values(std::move(v));
                        }
                        resp->set_revision(r.revision);
                      });
}

grpc::ServerUnaryReactor* StoreService::MultiSet(
    grpc::CallbackServerContext* ctx, const v1::MultiSetRequest* req,
    v1::MultiSetResponse* resp) {
  std::vector<std::string> keys = ToVector(req->keys());
  return Write(options_.auth, ctx, keys, [&] {
    absl::StatusOr<int64_t> r = store_->MultiSet(keys, ToVector(req->values()));
    if (r.ok()) resp->set_revision(*r);
    return r.status();
  });
}

grpc::ServerUnaryReactor* StoreService::Append(grpc::CallbackServerContext* ctx,
                                               const v1::AppendRequest* req,
                                               v1::AppendResponse* resp) {
  return Write(options_.auth, ctx, absl::MakeConstSpan(&req->key(), 1), [&] {
    absl::StatusOr<int64_t> r = store_->Append(req->key(), req->value());
    if (r.ok()) resp->set_revision(*r);
    return r.status();
  });
}

grpc::ServerUnaryReactor* StoreService::ListKeys(
    grpc::CallbackServerContext* ctx, const v1::ListKeysRequest* req,
    v1::ListKeysResponse* resp) {
  if (req->page_size() < 0) {
    return FinishNow(ctx,
                     absl::InvalidArgumentError(absl::StrCat(
                         "page_size must be >= 0, got ", req->page_size())));
  }
  absl::StatusOr<std::string> prefix =
      AuthorizedPrefix(options_.auth, *ctx, req->prefix());
  if (!prefix.ok()) return FinishNow(ctx, prefix.status());
  absl::StatusOr<store::ListResult> r =
      store_->ListKeys(*prefix, req->page_size(), req->page_token());
  if (r.ok()) {
    for (std::string& k : r->keys) resp->add_keys(std::move(k));
    resp->set_next_page_token(std::move(r->next_page_token));
    resp->set_revision(r->revision);
  }
  return FinishNow(ctx, r.status());
}

grpc::ServerWriteReactor<v1::WatchResponse>* StoreService::Watch(
    grpc::CallbackServerContext* ctx, const v1::WatchRequest* req) {
  auto* reactor = new EventStream<v1::WatchResponse>(
      store_, options_.watch_buffer_bytes, AppendEvent, options_.watch_gauges);
  Grant grant;
  absl::StatusOr<std::string> prefix =
      AuthorizedPrefix(options_.auth, *ctx, req->prefix(), &grant);
  if (!prefix.ok()) {
    reactor->Fail(prefix.status());
    return reactor;
  }
  absl::StatusOr<QuotaCharge> charge = ChargeCall(
      options_.quotas, options_.auth, grant, *ctx, {{Quota::kWatchStreams, 1}});
  if (!charge.ok()) {
    reactor->Fail(charge.status());
    return reactor;
  }
  reactor->Hold(std::move(*charge));
  if (absl::Status s = EndWithGrant(options_.auth, grant, *reactor); !s.ok()) {
    reactor->Fail(s);
    return reactor;
  }
  reactor->Start(*prefix, req->from_revision());
  return reactor;
}

}  // namespace cohort::server

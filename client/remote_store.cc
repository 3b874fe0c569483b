#include "client/remote_store.h"

#include "absl/strings/str_cat.h"

namespace cohort {
namespace {

template <typename Repeated>
void CopyKeys(absl::Span<const std::string> keys, Repeated* out) {
  out->Reserve(keys.size());
  for (const std::string& k : keys) out->Add(std::string(k));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RemoteStore>> RemoteStore::Connect(
    const RemoteStoreOptions& options) {
  absl::StatusOr<std::shared_ptr<Connection>> connection =
      Connection::Open(options);
  if (!connection.ok()) return connection.status();
  return std::unique_ptr<RemoteStore>(new RemoteStore(std::move(*connection)));
}

RemoteStore::RemoteStore(std::shared_ptr<Connection> connection)
    : connection_(std::move(connection)),
      stub_(v1::Store::NewStub(connection_->channel())) {}

absl::Status RemoteStore::Set(absl::string_view key, absl::string_view value) {
  v1::SetRequest req;
  req.set_key(std::string(key));
  req.set_value(std::string(value));
  v1::SetResponse resp;
  return Call("set", NotRepeatable(), &v1::Store::Stub::Set, req, &resp);
}

absl::StatusOr<std::string> RemoteStore::Get(absl::string_view key,
                                             absl::Duration timeout) {
  v1::GetRequest req;
  req.set_key(std::string(key));
  req.set_timeout_ms(ToMillis(timeout));
  v1::GetResponse resp;
  if (absl::Status s =
          Call("get", Blocking(timeout), &v1::Store::Stub::Get, req, &resp);
      !s.ok()) {
    return s;
  }
  return std::move(*resp.mutable_value());
}

absl::StatusOr<int64_t> RemoteStore::Add(absl::string_view key, int64_t delta) {
  v1::AddRequest req;
  req.set_key(std::string(key));
  req.set_delta(delta);
  v1::AddResponse resp;
  if (absl::Status s =
          Call("add", NotRepeatable(), &v1::Store::Stub::Add, req, &resp);
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
  if (absl::Status s = Call("compare_set", NotRepeatable(),
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
  return Call("wait", Blocking(timeout), &v1::Store::Stub::Wait, req, &resp);
}

absl::StatusOr<bool> RemoteStore::Check(absl::Span<const std::string> keys) {
  v1::CheckRequest req;
  CopyKeys(keys, req.mutable_keys());
  v1::CheckResponse resp;
  if (absl::Status s =
          Call("check", Repeatable(), &v1::Store::Stub::Check, req, &resp);
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
  if (absl::Status s =
          Call("delete", NotRepeatable(), &v1::Store::Stub::Delete, req, &resp);
      !s.ok()) {
    return s;
  }
  return resp.deleted();
}

absl::StatusOr<int64_t> RemoteStore::NumKeys() {
  v1::NumKeysRequest req;
  v1::NumKeysResponse resp;
  if (absl::Status s =
          Call("num_keys", Repeatable(), &v1::Store::Stub::NumKeys, req, &resp);
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
  if (absl::Status s = Call("multi_get", Blocking(timeout),
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
  return Call("multi_set", NotRepeatable(), &v1::Store::Stub::MultiSet, req,
              &resp);
}

absl::Status RemoteStore::Append(absl::string_view key,
                                 absl::string_view value) {
  v1::AppendRequest req;
  req.set_key(std::string(key));
  req.set_value(std::string(value));
  v1::AppendResponse resp;
  return Call("append", NotRepeatable(), &v1::Store::Stub::Append, req, &resp);
}

absl::StatusOr<KeyList> RemoteStore::ListKeys(absl::string_view prefix) {
  KeyList list;
  v1::ListKeysRequest req;
  req.set_prefix(std::string(prefix));
  do {
    v1::ListKeysResponse resp;
    if (absl::Status s = Call("list_keys", Repeatable(),
                              &v1::Store::Stub::ListKeys, req, &resp);
        !s.ok()) {
      return s;
    }
    if (req.page_token().empty()) list.revision = resp.revision();
    for (std::string& k : *resp.mutable_keys())
      list.keys.push_back(std::move(k));
    req.set_page_token(std::move(*resp.mutable_next_page_token()));
  } while (!req.page_token().empty());
  return list;
}

// A store watch: a ResumingStream of v1::Event turned into WatchEvents.
class RemoteStore::RemoteWatch final : public WatchHandle {
 public:
  RemoteWatch(RemoteStore* store, std::string prefix, int64_t from_revision,
              WatchCallback callback)
      : stream_(
            store->connection_, "watch", from_revision,
            [store, prefix = std::move(prefix)](grpc::ClientContext* context,
                                                int64_t from) {
              v1::WatchRequest req;
              req.set_prefix(prefix);
              req.set_from_revision(from);
              return store->stub_->Watch(context, req);
            },
            [callback = std::move(callback)](const v1::Event& e) {
              WatchEvent event;
              event.type = e.type() == v1::Event::DELETE
                               ? WatchEvent::Type::kDelete
                               : WatchEvent::Type::kPut;
              event.key = e.key();
              event.value = e.value();
              event.revision = e.revision();
              callback(event);
            }) {}

  void Cancel() override { stream_.Cancel(); }
  absl::Status Wait() override { return stream_.Wait(); }
  absl::Status WaitStarted() { return stream_.WaitStarted(); }

 private:
  ResumingStream<v1::WatchResponse> stream_;
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

#include "server/ha/fake_etcd.h"

#include <chrono>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace cohort::server {
namespace {

using etcdserverpb::Compare;
using etcdserverpb::RangeRequest;
using etcdserverpb::RangeResponse;
using etcdserverpb::RequestOp;
using etcdserverpb::ResponseHeader;
using etcdserverpb::TxnRequest;
using etcdserverpb::TxnResponse;
using etcdserverpb::WatchRequest;
using etcdserverpb::WatchResponse;

// etcd's watchBatchMaxRevs: a watch response holds the events of at most
// this many revisions, and never part of one.
constexpr int kWatchBatchRevisions = 1000;

// etcd's answers, word for word.
constexpr absl::string_view kCompacted =
    "etcdserver: mvcc: required revision has been compacted";
constexpr absl::string_view kFutureRevision =
    "etcdserver: mvcc: required revision is a future revision";
constexpr absl::string_view kLeaseNotFound =
    "etcdserver: requested lease not found";
constexpr absl::string_view kDuplicateKey =
    "etcdserver: duplicate key given in txn request";

// Whether `key` is in etcd's range [start, end): one key when `end` is
// empty, every key from `start` on when it is "\0".
bool InRange(absl::string_view key, absl::string_view start,
             absl::string_view end) {
  if (end.empty()) return key == start;
  if (end == absl::string_view("\0", 1)) return key >= start;
  return key >= start && key < end;
}

int Sign(int64_t a, int64_t b) { return a < b ? -1 : (a > b ? 1 : 0); }

// etcd's checkIntervals, for one branch: a key may be put once, and not
// both put and deleted.
bool HasDuplicateKeys(
    const google::protobuf::RepeatedPtrField<RequestOp>& ops) {
  std::set<std::string> puts;
  for (const RequestOp& op : ops) {
    if (op.has_request_put() && !puts.insert(op.request_put().key()).second) {
      return true;
    }
  }
  for (const RequestOp& op : ops) {
    if (!op.has_request_delete_range()) continue;
    const auto& del = op.request_delete_range();
    for (const std::string& key : puts) {
      if (InRange(key, del.key(), del.range_end())) return true;
    }
  }
  return false;
}

}  // namespace

// The store every member serves, and what the test sees of the members.
class FakeEtcd::State {
 public:
  explicit State(int members) : members_(members) {}

  mutable absl::Mutex mu;
  // Signalled on every new revision, member stop and watch request.
  absl::CondVar changed;

  ResponseHeader Header(int member) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ResponseHeader h;
    h.set_cluster_id(0xc0407);
    h.set_member_id(member + 1);
    h.set_revision(revision_);
    h.set_raft_term(1);
    return h;
  }

  void Count(int member, absl::string_view method) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    ++members_[member].calls[method];
  }
  int64_t calls(int member, absl::string_view method) const
      ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    auto it = members_[member].calls.find(method);
    return it == members_[member].calls.end() ? 0 : it->second;
  }
  // A member refuses calls while stopped or isolated.
  void SetRefusing(int member, bool refusing) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    members_[member].refusing = refusing;
    changed.SignalAll();
  }
  bool refusing(int member) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return members_[member].refusing;
  }

  int64_t revision() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return revision_;
  }
  int64_t compacted() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return compacted_;
  }
  void Compact(int64_t revision) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    compacted_ = std::max(compacted_, std::min(revision, revision_));
    changed.SignalAll();
  }

  // The key's newest version at revision `at`; null if absent then.
  const mvccpb::KeyValue* Latest(absl::string_view key, int64_t at) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = keys_.find(std::string(key));
    if (it == keys_.end()) return nullptr;
    for (auto v = it->second.rbegin(); v != it->second.rend(); ++v) {
      if (v->revision > at) continue;
      return v->deleted ? nullptr : &v->kv;
    }
    return nullptr;
  }

  // Reads see the writes of the transaction in progress.
  int64_t ReadRevision() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return writing_ ? revision_ + 1 : revision_;
  }

  grpc::Status CheckReadable(int64_t revision) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (revision > 0 && revision < compacted_) {
      return grpc::Status(grpc::StatusCode::OUT_OF_RANGE,
                          std::string(kCompacted));
    }
    if (revision > revision_) {
      return grpc::Status(grpc::StatusCode::OUT_OF_RANGE,
                          std::string(kFutureRevision));
    }
    return grpc::Status::OK;
  }

  grpc::Status Range(int member, const RangeRequest& req, RangeResponse* resp)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (grpc::Status s = CheckReadable(req.revision()); !s.ok()) return s;
    const int64_t at = req.revision() > 0 ? req.revision() : ReadRevision();
    *resp->mutable_header() = Header(member);
    int64_t count = 0;
    auto add = [&](const std::string& key) {
      const mvccpb::KeyValue* kv = Latest(key, at);
      if (kv == nullptr) return;
      ++count;
      if (req.count_only()) return;
      if (req.limit() > 0 && resp->kvs_size() >= req.limit()) return;
      mvccpb::KeyValue* out = resp->add_kvs();
      *out = *kv;
      if (req.keys_only()) out->clear_value();
    };
    if (req.range_end().empty()) {
      add(req.key());
    } else {
      for (auto it = keys_.lower_bound(req.key());
           it != keys_.end() && InRange(it->first, req.key(), req.range_end());
           ++it) {
        add(it->first);
      }
    }
    resp->set_count(count);
    resp->set_more(req.limit() > 0 && count > req.limit());
    return grpc::Status::OK;
  }

  // Writes: each Put and Delete below belongs to the revision after the
  // current one, which Commit creates if any of them changed something (a
  // transaction is one revision).
  grpc::Status CheckLease(int64_t lease) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (lease != 0 && leases_.find(lease) == leases_.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          std::string(kLeaseNotFound));
    }
    return grpc::Status::OK;
  }

  void Put(const std::string& key, const std::string& value, int64_t lease,
           mvccpb::KeyValue* prev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int64_t rev = revision_ + 1;
    writing_ = true;
    const mvccpb::KeyValue* old = Latest(key, rev);
    mvccpb::Event event;
    event.set_type(mvccpb::Event::PUT);
    mvccpb::KeyValue& kv = *event.mutable_kv();
    kv.set_key(key);
    kv.set_value(value);
    kv.set_mod_revision(rev);
    kv.set_create_revision(old != nullptr ? old->create_revision() : rev);
    kv.set_version(old != nullptr ? old->version() + 1 : 1);
    kv.set_lease(lease);
    if (old != nullptr) {
      *event.mutable_prev_kv() = *old;
      if (prev != nullptr) *prev = *old;
      if (old->lease() != lease) DetachLease(old->lease(), key);
    }
    if (lease != 0) leases_[lease].keys.insert(key);
    AddVersion(key, Version{rev, false, kv});
    events_.push_back(std::move(event));
  }

  int64_t Delete(const std::string& start, const std::string& end,
                 etcdserverpb::DeleteRangeResponse* resp)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int64_t rev = revision_ + 1;
    std::vector<std::string> doomed;
    if (end.empty()) {
      if (Latest(start, rev) != nullptr) doomed.push_back(start);
    } else {
      for (auto it = keys_.lower_bound(start);
           it != keys_.end() && InRange(it->first, start, end); ++it) {
        if (Latest(it->first, rev) != nullptr) doomed.push_back(it->first);
      }
    }
    for (const std::string& key : doomed) {
      writing_ = true;
      const mvccpb::KeyValue old = *Latest(key, rev);
      DetachLease(old.lease(), key);
      mvccpb::Event event;
      event.set_type(mvccpb::Event::DELETE);
      event.mutable_kv()->set_key(key);
      event.mutable_kv()->set_mod_revision(rev);
      *event.mutable_prev_kv() = old;
      if (resp != nullptr) *resp->add_prev_kvs() = old;
      AddVersion(key, Version{rev, true, {}});
      events_.push_back(std::move(event));
    }
    return static_cast<int64_t>(doomed.size());
  }

  void Commit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!writing_) return;
    writing_ = false;
    ++revision_;
    changed.SignalAll();
  }

  grpc::Status Txn(int member, const TxnRequest& req, TxnResponse* resp)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (HasDuplicateKeys(req.success()) || HasDuplicateKeys(req.failure())) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          std::string(kDuplicateKey));
    }
    bool succeeded = true;
    for (const Compare& c : req.compare()) {
      if (!c.range_end().empty()) {
        return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            "the fake etcd compares single keys only");
      }
      succeeded = succeeded && Holds(c);
    }
    const auto& ops = succeeded ? req.success() : req.failure();
    for (const RequestOp& op : ops) {
      grpc::Status s;
      if (op.has_request_txn()) {
        s = grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                         "the fake etcd has no nested transactions");
      } else if (op.has_request_put()) {
        s = CheckLease(op.request_put().lease());
      } else if (op.has_request_range()) {
        s = CheckReadable(op.request_range().revision());
      }
      if (!s.ok()) return s;
    }
    for (const RequestOp& op : ops) {
      etcdserverpb::ResponseOp* out = resp->add_responses();
      if (op.has_request_range()) {
        Range(member, op.request_range(), out->mutable_response_range())
            .IgnoreError();  // Checked above.
      } else if (op.has_request_put()) {
        const auto& put = op.request_put();
        auto* r = out->mutable_response_put();
        Put(put.key(), put.value(), put.lease(),
            put.prev_kv() ? r->mutable_prev_kv() : nullptr);
      } else if (op.has_request_delete_range()) {
        const auto& del = op.request_delete_range();
        auto* r = out->mutable_response_delete_range();
        r->set_deleted(
            Delete(del.key(), del.range_end(), del.prev_kv() ? r : nullptr));
      }
    }
    Commit();
    for (etcdserverpb::ResponseOp& out : *resp->mutable_responses()) {
      if (out.has_response_put()) {
        *out.mutable_response_put()->mutable_header() = Header(member);
      } else if (out.has_response_delete_range()) {
        *out.mutable_response_delete_range()->mutable_header() = Header(member);
      }
    }
    resp->set_succeeded(succeeded);
    *resp->mutable_header() = Header(member);
    return grpc::Status::OK;
  }

  // Leases, on the fake's clock.
  int64_t GrantLease(int64_t id, int64_t ttl_seconds)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (id == 0) id = next_lease_++;
    Lease& lease = leases_[id];
    lease.ttl = std::max<int64_t>(1, ttl_seconds);
    lease.deadline = now_ + absl::Seconds(lease.ttl);
    return id;
  }
  bool HasLease(int64_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return leases_.find(id) != leases_.end();
  }
  // The lease's TTL once kept alive; 0 if it is gone.
  int64_t KeepAlive(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = leases_.find(id);
    if (it == leases_.end()) return 0;
    it->second.deadline = now_ + absl::Seconds(it->second.ttl);
    return it->second.ttl;
  }
  bool RevokeLease(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = leases_.find(id);
    if (it == leases_.end()) return false;
    const std::set<std::string> keys = std::move(it->second.keys);
    leases_.erase(it);
    for (const std::string& key : keys) Delete(key, "", nullptr);
    Commit();
    return true;
  }
  void AdvanceClock(absl::Duration d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    now_ += d;
    std::vector<int64_t> expired;
    for (const auto& [id, lease] : leases_) {
      if (lease.deadline <= now_) expired.push_back(id);
    }
    for (int64_t id : expired) RevokeLease(id);
  }

  // Watches: the events of revisions from `from` on, of keys in
  // [key, range_end), at most kWatchBatchRevisions revisions of them;
  // `*next` becomes the first revision not looked at.
  void CollectEvents(int64_t from, absl::string_view key,
                     absl::string_view range_end,
                     const std::function<bool(const mvccpb::Event&)>& keep,
                     WatchResponse* resp, int64_t* next) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    *next = revision_ + 1;
    auto it = std::lower_bound(events_.begin(), events_.end(), from,
                               [](const mvccpb::Event& e, int64_t r) {
                                 return e.kv().mod_revision() < r;
                               });
    int revisions = 0;
    int64_t last = 0;
    for (; it != events_.end(); ++it) {
      const int64_t rev = it->kv().mod_revision();
      if (!InRange(it->kv().key(), key, range_end) || !keep(*it)) continue;
      if (rev != last) {
        if (revisions == kWatchBatchRevisions) {
          *next = rev;
          return;
        }
        ++revisions;
        last = rev;
      }
      *resp->add_events() = *it;
    }
  }

  RangeHook range_hook ABSL_GUARDED_BY(mu);

 private:
  struct Version {
    int64_t revision = 0;
    bool deleted = false;
    mvccpb::KeyValue kv;  // Unless deleted.
  };
  struct Lease {
    int64_t ttl = 0;
    absl::Duration deadline;
    std::set<std::string> keys;
  };
  struct MemberState {
    bool refusing = false;
    absl::flat_hash_map<std::string, int64_t> calls;
  };

  void AddVersion(const std::string& key, Version v)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<Version>& versions = keys_[key];
    // A key changes once per transaction (HasDuplicateKeys).
    if (!versions.empty() && versions.back().revision == v.revision) {
      versions.back() = std::move(v);
    } else {
      versions.push_back(std::move(v));
    }
  }

  void DetachLease(int64_t lease, const std::string& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = leases_.find(lease);
    if (it != leases_.end()) it->second.keys.erase(key);
  }

  bool Holds(const Compare& c) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const mvccpb::KeyValue* found = Latest(c.key(), revision_);
    // etcd: a missing key compares as all zeros, but never by value.
    if (found == nullptr && c.target() == Compare::VALUE) return false;
    const mvccpb::KeyValue kv = found != nullptr ? *found : mvccpb::KeyValue();
    int sign = 0;
    switch (c.target()) {
      case Compare::VERSION:
        sign = Sign(kv.version(), c.version());
        break;
      case Compare::CREATE:
        sign = Sign(kv.create_revision(), c.create_revision());
        break;
      case Compare::MOD:
        sign = Sign(kv.mod_revision(), c.mod_revision());
        break;
      case Compare::VALUE:
        sign = kv.value().compare(c.value());
        sign = sign < 0 ? -1 : (sign > 0 ? 1 : 0);
        break;
      case Compare::LEASE:
        sign = Sign(kv.lease(), c.lease());
        break;
      default:
        return false;
    }
    switch (c.result()) {
      case Compare::EQUAL:
        return sign == 0;
      case Compare::GREATER:
        return sign > 0;
      case Compare::LESS:
        return sign < 0;
      case Compare::NOT_EQUAL:
        return sign != 0;
      default:
        return false;
    }
  }

  int64_t revision_ ABSL_GUARDED_BY(mu) = 1;
  int64_t compacted_ ABSL_GUARDED_BY(mu) = 0;
  bool writing_ ABSL_GUARDED_BY(mu) = false;
  std::map<std::string, std::vector<Version>> keys_ ABSL_GUARDED_BY(mu);
  // Every change, in revision order (a delete's kv holds its key and the
  // revision of the delete, as etcd's does).
  std::vector<mvccpb::Event> events_ ABSL_GUARDED_BY(mu);
  std::map<int64_t, Lease> leases_ ABSL_GUARDED_BY(mu);
  int64_t next_lease_ ABSL_GUARDED_BY(mu) = 0x7e5700001;
  absl::Duration now_ ABSL_GUARDED_BY(mu);
  std::vector<MemberState> members_ ABSL_GUARDED_BY(mu);
};

// One member: its gRPC server and the services it runs over the store.
class FakeEtcd::Member {
 public:
  Member(State* state, int index) : state_(state), index_(index) {}
  ~Member();

  // Serves on the member's port (the kernel's choice the first time).
  absl::Status Serve();
  // Stops serving; idempotent.
  void Stop();
  // Refuses every call while serving, until Serve.
  void Isolate() { state_->SetRefusing(index_, true); }

  std::string endpoint() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  class KvService;
  class WatchService;
  class LeaseService;

  State* const state_;
  const int index_;
  int port_ = 0;
  std::unique_ptr<KvService> kv_;
  std::unique_ptr<WatchService> watch_;
  std::unique_ptr<LeaseService> lease_;
  std::unique_ptr<grpc::Server> server_;
};

namespace {

// What etcd answers on a member cut off from its cluster's leader.
grpc::Status NoLeader() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "etcdserver: no leader");
}

}  // namespace

class FakeEtcd::Member::KvService final : public etcdserverpb::KV::Service {
 public:
  KvService(State* state, int member) : state_(state), member_(member) {}

  grpc::Status Range(grpc::ServerContext*, const RangeRequest* req,
                     RangeResponse* resp) override {
    state_->Count(member_, "Range");
    RangeHook hook;
    {
      absl::MutexLock lock(&state_->mu);
      hook = state_->range_hook;
    }
    if (hook) hook(member_, *req);
    absl::MutexLock lock(&state_->mu);
    if (state_->refusing(member_)) return NoLeader();
    return state_->Range(member_, *req, resp);
  }

  grpc::Status Put(grpc::ServerContext*, const etcdserverpb::PutRequest* req,
                   etcdserverpb::PutResponse* resp) override {
    state_->Count(member_, "Put");
    absl::MutexLock lock(&state_->mu);
    if (state_->refusing(member_)) return NoLeader();
    if (grpc::Status s = state_->CheckLease(req->lease()); !s.ok()) return s;
    state_->Put(req->key(), req->value(), req->lease(),
                req->prev_kv() ? resp->mutable_prev_kv() : nullptr);
    state_->Commit();
    *resp->mutable_header() = state_->Header(member_);
    return grpc::Status::OK;
  }

  grpc::Status DeleteRange(grpc::ServerContext*,
                           const etcdserverpb::DeleteRangeRequest* req,
                           etcdserverpb::DeleteRangeResponse* resp) override {
    state_->Count(member_, "DeleteRange");
    absl::MutexLock lock(&state_->mu);
    if (state_->refusing(member_)) return NoLeader();
    resp->set_deleted(state_->Delete(req->key(), req->range_end(),
                                     req->prev_kv() ? resp : nullptr));
    state_->Commit();
    *resp->mutable_header() = state_->Header(member_);
    return grpc::Status::OK;
  }

  grpc::Status Txn(grpc::ServerContext*, const TxnRequest* req,
                   TxnResponse* resp) override {
    state_->Count(member_, "Txn");
    absl::MutexLock lock(&state_->mu);
    if (state_->refusing(member_)) return NoLeader();
    return state_->Txn(member_, *req, resp);
  }

 private:
  State* const state_;
  const int member_;
};

class FakeEtcd::Member::WatchService final
    : public etcdserverpb::Watch::Service {
 public:
  WatchService(State* state, int member) : state_(state), member_(member) {}

  // The requests are read on a thread of their own, so that this one can
  // wait for new revisions and requests at once.
  grpc::Status Watch(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<WatchResponse, WatchRequest>* stream) override {
    state_->Count(member_, "Watch");
    // Written by the reader under the store's lock.
    std::deque<WatchRequest> inbox;
    bool ended = false;
    std::thread reader([&] {
      WatchRequest req;
      while (stream->Read(&req)) {
        absl::MutexLock lock(&state_->mu);
        inbox.push_back(req);
        state_->changed.SignalAll();
      }
      absl::MutexLock lock(&state_->mu);
      ended = true;
      state_->changed.SignalAll();
    });
    std::vector<Watcher> watchers;
    int64_t next_id = 0;
    bool refused = false;
    for (;;) {
      std::vector<WatchResponse> out;
      {
        absl::MutexLock lock(&state_->mu);
        auto due = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
          for (const Watcher& w : watchers) {
            if (w.next <= state_->revision()) return true;
          }
          return false;
        };
        while (!ended && !state_->refusing(member_) && inbox.empty() &&
               !due()) {
          state_->changed.Wait(&state_->mu);
        }
        refused = state_->refusing(member_);
        if (ended || refused) break;
        for (const WatchRequest& req : inbox) {
          Handle(req, watchers, next_id, out);
        }
        inbox.clear();
        Collect(watchers, out);
      }
      bool written = true;
      for (const WatchResponse& resp : out) {
        written = written && stream->Write(resp);
      }
      if (!written) break;
    }
    context->TryCancel();
    reader.join();
    return refused ? NoLeader() : grpc::Status::OK;
  }

 private:
  struct Watcher {
    int64_t id = 0;
    std::string key;
    std::string range_end;
    int64_t next = 0;  // The first revision not yet sent.
    bool no_put = false;
    bool no_delete = false;
    bool prev_kv = false;
  };

  void Handle(const WatchRequest& req, std::vector<Watcher>& watchers,
              int64_t& next_id, std::vector<WatchResponse>& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    WatchResponse resp;
    *resp.mutable_header() = state_->Header(member_);
    if (req.has_create_request()) {
      const auto& c = req.create_request();
      Watcher w;
      w.id = c.watch_id() != 0 ? c.watch_id() : next_id++;
      w.key = c.key();
      w.range_end = c.range_end();
      w.next =
          c.start_revision() > 0 ? c.start_revision() : state_->revision() + 1;
      for (int f : c.filters()) {
        if (f == etcdserverpb::WatchCreateRequest::NOPUT) w.no_put = true;
        if (f == etcdserverpb::WatchCreateRequest::NODELETE) {
          w.no_delete = true;
        }
      }
      w.prev_kv = c.prev_kv();
      resp.set_watch_id(w.id);
      resp.set_created(true);
      watchers.push_back(std::move(w));
      out.push_back(std::move(resp));
    } else if (req.has_cancel_request()) {
      const int64_t id = req.cancel_request().watch_id();
      for (auto it = watchers.begin(); it != watchers.end(); ++it) {
        if (it->id != id) continue;
        watchers.erase(it);
        resp.set_watch_id(id);
        resp.set_canceled(true);
        out.push_back(std::move(resp));
        break;
      }
    } else if (req.has_progress_request()) {
      resp.set_watch_id(-1);  // etcd's: for every watch of the stream.
      out.push_back(std::move(resp));
    }
  }

  // The events due to each watcher; a watcher from a compacted revision is
  // cancelled, as etcd does, with the compaction's revision.
  void Collect(std::vector<Watcher>& watchers, std::vector<WatchResponse>& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    for (auto it = watchers.begin(); it != watchers.end();) {
      Watcher& w = *it;
      WatchResponse resp;
      *resp.mutable_header() = state_->Header(member_);
      resp.set_watch_id(w.id);
      if (w.next < state_->compacted()) {
        resp.set_canceled(true);
        resp.set_compact_revision(state_->compacted());
        resp.set_cancel_reason(std::string(kCompacted));
        out.push_back(std::move(resp));
        it = watchers.erase(it);
        continue;
      }
      if (w.next <= state_->revision()) {
        state_->CollectEvents(
            w.next, w.key, w.range_end,
            [&](const mvccpb::Event& e) {
              return e.type() == mvccpb::Event::PUT ? !w.no_put : !w.no_delete;
            },
            &resp, &w.next);
        if (!w.prev_kv) {
          for (mvccpb::Event& e : *resp.mutable_events()) e.clear_prev_kv();
        }
        if (resp.events_size() > 0) out.push_back(std::move(resp));
      }
      ++it;
    }
  }

  State* const state_;
  const int member_;
};

class FakeEtcd::Member::LeaseService final
    : public etcdserverpb::Lease::Service {
 public:
  LeaseService(State* state, int member) : state_(state), member_(member) {}

  grpc::Status LeaseGrant(grpc::ServerContext*,
                          const etcdserverpb::LeaseGrantRequest* req,
                          etcdserverpb::LeaseGrantResponse* resp) override {
    state_->Count(member_, "LeaseGrant");
    absl::MutexLock lock(&state_->mu);
    if (state_->refusing(member_)) return NoLeader();
    if (req->id() != 0 && state_->HasLease(req->id())) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "etcdserver: lease already exists");
    }
    resp->set_id(state_->GrantLease(req->id(), req->ttl()));
    resp->set_ttl(std::max<int64_t>(1, req->ttl()));
    *resp->mutable_header() = state_->Header(member_);
    return grpc::Status::OK;
  }

  grpc::Status LeaseRevoke(grpc::ServerContext*,
                           const etcdserverpb::LeaseRevokeRequest* req,
                           etcdserverpb::LeaseRevokeResponse* resp) override {
    state_->Count(member_, "LeaseRevoke");
    absl::MutexLock lock(&state_->mu);
    if (state_->refusing(member_)) return NoLeader();
    if (!state_->RevokeLease(req->id())) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          std::string(kLeaseNotFound));
    }
    *resp->mutable_header() = state_->Header(member_);
    return grpc::Status::OK;
  }

  grpc::Status LeaseKeepAlive(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<etcdserverpb::LeaseKeepAliveResponse,
                               etcdserverpb::LeaseKeepAliveRequest>* stream)
      override {
    state_->Count(member_, "LeaseKeepAlive");
    etcdserverpb::LeaseKeepAliveRequest req;
    while (stream->Read(&req)) {
      etcdserverpb::LeaseKeepAliveResponse resp;
      {
        absl::MutexLock lock(&state_->mu);
        if (state_->refusing(member_)) return NoLeader();
        resp.set_id(req.id());
        resp.set_ttl(state_->KeepAlive(req.id()));
        *resp.mutable_header() = state_->Header(member_);
      }
      if (!stream->Write(resp)) break;
    }
    return grpc::Status::OK;
  }

 private:
  State* const state_;
  const int member_;
};

absl::Status FakeEtcd::Member::Serve() {
  kv_ = std::make_unique<KvService>(state_, index_);
  watch_ = std::make_unique<WatchService>(state_, index_);
  lease_ = std::make_unique<LeaseService>(state_, index_);
  state_->SetRefusing(index_, false);
  grpc::ServerBuilder builder;
  int selected = 0;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", port_),
                           grpc::InsecureServerCredentials(), &selected);
  builder.RegisterService(kv_.get());
  builder.RegisterService(watch_.get());
  builder.RegisterService(lease_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || selected == 0) {
    server_.reset();
    state_->SetRefusing(index_, true);
    return absl::UnavailableError(absl::StrCat(
        "fake etcd member ", index_, " could not listen on 127.0.0.1:", port_));
  }
  port_ = selected;
  return absl::OkStatus();
}

void FakeEtcd::Member::Stop() {
  if (server_ == nullptr) return;
  // Ends the watch streams, which wait on the store rather than on the
  // network; Shutdown cancels the rest and waits for every handler.
  state_->SetRefusing(index_, true);
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
  server_.reset();
}

FakeEtcd::Member::~Member() { Stop(); }

FakeEtcd::FakeEtcd() = default;

FakeEtcd::~FakeEtcd() {
  for (auto& m : members_) m->Stop();
}

absl::StatusOr<std::unique_ptr<FakeEtcd>> FakeEtcd::Start(int members) {
  if (members < 1) {
    return absl::InvalidArgumentError("a fake etcd needs at least 1 member");
  }
  std::unique_ptr<FakeEtcd> etcd(new FakeEtcd());
  etcd->state_ = std::make_unique<State>(members);
  for (int i = 0; i < members; ++i) {
    etcd->members_.push_back(std::make_unique<Member>(etcd->state_.get(), i));
    if (absl::Status s = etcd->members_.back()->Serve(); !s.ok()) return s;
  }
  return etcd;
}

int FakeEtcd::members() const { return static_cast<int>(members_.size()); }

std::string FakeEtcd::endpoint(int member) const {
  return members_[member]->endpoint();
}

std::vector<std::string> FakeEtcd::endpoints() const {
  std::vector<std::string> out;
  for (const auto& m : members_) out.push_back(m->endpoint());
  return out;
}

void FakeEtcd::Stop(int member) { members_[member]->Stop(); }

void FakeEtcd::Isolate(int member) { members_[member]->Isolate(); }

absl::Status FakeEtcd::Restart(int member) {
  members_[member]->Stop();
  return members_[member]->Serve();
}

absl::StatusOr<int64_t> FakeEtcd::Put(absl::string_view key,
                                      absl::string_view value, int64_t lease) {
  absl::MutexLock lock(&state_->mu);
  if (grpc::Status s = state_->CheckLease(lease); !s.ok()) {
    return absl::NotFoundError(s.error_message());
  }
  state_->Put(std::string(key), std::string(value), lease, nullptr);
  state_->Commit();
  return state_->revision();
}

int64_t FakeEtcd::Delete(absl::string_view key) {
  absl::MutexLock lock(&state_->mu);
  state_->Delete(std::string(key), "", nullptr);
  state_->Commit();
  return state_->revision();
}

std::optional<mvccpb::KeyValue> FakeEtcd::Get(absl::string_view key) const {
  absl::MutexLock lock(&state_->mu);
  const mvccpb::KeyValue* kv = state_->Latest(key, state_->revision());
  if (kv == nullptr) return std::nullopt;
  return *kv;
}

int64_t FakeEtcd::revision() const {
  absl::MutexLock lock(&state_->mu);
  return state_->revision();
}

void FakeEtcd::Compact(int64_t revision) {
  absl::MutexLock lock(&state_->mu);
  state_->Compact(revision);
}

int64_t FakeEtcd::GrantLease(int64_t ttl_seconds) {
  absl::MutexLock lock(&state_->mu);
  return state_->GrantLease(0, ttl_seconds);
}

bool FakeEtcd::RevokeLease(int64_t lease) {
  absl::MutexLock lock(&state_->mu);
  return state_->RevokeLease(lease);
}

bool FakeEtcd::HasLease(int64_t lease) const {
  absl::MutexLock lock(&state_->mu);
  return state_->HasLease(lease);
}

void FakeEtcd::AdvanceClock(absl::Duration d) {
  absl::MutexLock lock(&state_->mu);
  state_->AdvanceClock(d);
}

int64_t FakeEtcd::calls(int member, absl::string_view method) const {
  return state_->calls(member, method);
}

void FakeEtcd::SetRangeHook(RangeHook hook) {
  absl::MutexLock lock(&state_->mu);
  state_->range_hook = std::move(hook);
}

}  // namespace cohort::server

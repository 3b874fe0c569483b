#include "server/ha/etcd_leadership.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "grpcpp/create_channel.h"

namespace cohort::server {
namespace {

// etcd's require-leader metadata (as in etcd_engine.cc): a member cut off
// from its quorum fails the call at once instead of holding it until the
// deadline, so that the next member is tried.
void RequireLeader(grpc::ClientContext* context) {
  context->AddMetadata("hasleader", "true");
}

}  // namespace

class EtcdLeadership::Impl {
 public:
  explicit Impl(EtcdLeadershipOptions options) : options_(std::move(options)) {
    for (const std::string& endpoint : options_.endpoints) {
      auto channel = grpc::CreateChannel(endpoint,
                                         grpc::InsecureChannelCredentials());
      kv_.push_back(etcdserverpb::KV::NewStub(channel));
      lease_.push_back(etcdserverpb::Lease::NewStub(channel));
    }
    thread_ = std::thread([this] { Run(); });
  }

  ~Impl() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }

 private:
  // Runs `call` on each endpoint in turn until one answers.
  template <typename Call>
  grpc::Status Try(Call call) {
    grpc::Status s;
    for (size_t i = 0; i < kv_.size(); ++i) {
      const size_t index = (current_ + i) % kv_.size();
      grpc::ClientContext context;
      context.set_deadline(
          absl::ToChronoTime(absl::Now() + options_.call_timeout));
      RequireLeader(&context);
      s = call(index, &context);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE &&
          s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
        current_ = index;
        return s;
      }
    }
    return s;
  }

  // Sleeps `d` unless stopping; returns whether stopping.
  bool Sleep(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&stopping_), d);
  }

  void Follow(const std::string& leader) {
    if (leading_ || leader != last_leader_ || !announced_) {
      leading_ = false;
      announced_ = true;
      last_leader_ = leader;
      if (options_.follows) options_.follows(leader);
    }
  }

  // One campaign: OK(true) if this replica won and should renew `lease`.
  bool Campaign(int64_t* lease, std::string* leader, bool* retry_now) {
    etcdserverpb::LeaseGrantRequest grant;
    grant.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(options_.ttl)));
    etcdserverpb::LeaseGrantResponse granted;
    if (!Try([&](size_t i, grpc::ClientContext* c) {
           return lease_[i]->LeaseGrant(c, grant, &granted);
         }).ok()) {
      return false;
    }
    etcdserverpb::TxnRequest txn;
    etcdserverpb::Compare* absent = txn.add_compare();
    absent->set_key(options_.key);
    absent->set_target(etcdserverpb::Compare::CREATE);
    absent->set_result(etcdserverpb::Compare::EQUAL);
    absent->set_create_revision(0);
    auto* put = txn.add_success()->mutable_request_put();
    put->set_key(options_.key);
    put->set_value(options_.address);
    put->set_lease(granted.id());
    txn.add_failure()->mutable_request_range()->set_key(options_.key);
    etcdserverpb::TxnResponse resp;
    if (!Try([&](size_t i, grpc::ClientContext* c) {
           return kv_[i]->Txn(c, txn, &resp);
         }).ok()) {
      return false;
    }
    if (resp.succeeded()) {
      *lease = granted.id();
      return true;
    }
    Revoke(granted.id());
    const auto& range = resp.responses(0).response_range();
    *leader = range.kvs().empty() ? "" : range.kvs(0).value();
    if (*leader == options_.address && !range.kvs().empty()) {
      // A previous life of this replica (killed before its lease ran out)
      // still holds the key: end its lease, and campaign again at once.
      Log("leadership: the key still names this replica from before a "
          "restart; revoking that lease");
      Revoke(range.kvs(0).lease());
      leader->clear();
      *retry_now = true;
    }
    return false;
  }

  bool KeepAlive(int64_t lease) {
    grpc::ClientContext context;
    context.set_deadline(
        absl::ToChronoTime(absl::Now() + options_.call_timeout));
    RequireLeader(&context);
    auto stream = lease_[current_]->LeaseKeepAlive(&context);
    etcdserverpb::LeaseKeepAliveRequest req;
    req.set_id(lease);
    etcdserverpb::LeaseKeepAliveResponse resp;
    const bool ok = stream->Write(req) && stream->Read(&resp) && resp.ttl() > 0;
    stream->WritesDone();
    context.TryCancel();
    stream->Finish().IgnoreError();
    if (!ok) current_ = (current_ + 1) % lease_.size();
    return ok;
  }

  void Revoke(int64_t lease) {
    etcdserverpb::LeaseRevokeRequest req;
    req.set_id(lease);
    etcdserverpb::LeaseRevokeResponse resp;
    Try([&](size_t i, grpc::ClientContext* c) {
      return lease_[i]->LeaseRevoke(c, req, &resp);
    }).IgnoreError();
  }

  void Log(absl::string_view line) {
    if (options_.log) options_.log(line);
  }

  void Run() {
    // A leader that has not renewed for this long stops acting as one:
    // etcd cannot have let another replica win before `ttl`.
    const absl::Duration margin = std::min(options_.ttl / 3, absl::Seconds(1));
    for (;;) {
      int64_t lease = 0;
      std::string leader;
      bool retry_now = false;
      if (Campaign(&lease, &leader, &retry_now)) {
        leading_ = true;
        announced_ = true;
        Log(absl::StrCat("leadership: this replica (", options_.address,
                         ") leads"));
        if (options_.elected) options_.elected();
        absl::Time renewed = absl::Now();
        for (;;) {
          if (Sleep(options_.ttl / 3)) {
            Revoke(lease);  // Resign: the next leader need not wait.
            return;
          }
          if (KeepAlive(lease)) {
            renewed = absl::Now();
          } else if (absl::Now() - renewed > options_.ttl - margin) {
            Log(absl::StrCat("leadership: could not renew the lease for ",
                             absl::FormatDuration(absl::Now() - renewed),
                             "; stepping down"));
            break;
          }
        }
        Follow("");
        continue;
      }
      if (retry_now) continue;
      Follow(leader);
      if (Sleep(options_.poll)) return;
    }
  }

  const EtcdLeadershipOptions options_;
  std::vector<std::unique_ptr<etcdserverpb::KV::Stub>> kv_;
  std::vector<std::unique_ptr<etcdserverpb::Lease::Stub>> lease_;
  size_t current_ = 0;  // The election thread's.
  bool leading_ = false;
  bool announced_ = false;
  std::string last_leader_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

EtcdLeadership::EtcdLeadership(EtcdLeadershipOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

EtcdLeadership::~EtcdLeadership() = default;

}  // namespace cohort::server

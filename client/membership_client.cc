#include "client/membership_client.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cohort/v1/coordination.grpc.pb.h"

namespace cohort {
namespace {

Member ToMember(const v1::MemberInfo& info) {
  return Member{info.name(), info.incarnation(), info.rank(), info.host(),
                absl::Milliseconds(info.heartbeat_age_ms())};
}

MemberEvent ToEvent(const v1::MemberEvent& e) {
  MemberEvent event;
  switch (e.type()) {
    case v1::MemberEvent::LEFT:
      event.type = MemberEvent::Type::kLeft;
      break;
    case v1::MemberEvent::FAILED:
      event.type = MemberEvent::Type::kFailed;
      break;
    case v1::MemberEvent::ERROR_REPORTED:
      event.type = MemberEvent::Type::kErrorReported;
      break;
    default:
      event.type = MemberEvent::Type::kJoined;
  }
  event.member = ToMember(e.member());
  event.message = e.message();
  event.revision = e.revision();
  return event;
}

// A joined member: heartbeats every interval on a thread of its own until
// it leaves, is destroyed, or learns it is no longer a member.
class GrpcGroupMember final : public GroupMember {
 public:
  GrpcGroupMember(std::shared_ptr<Connection> connection,
                  std::shared_ptr<v1::Membership::Stub> stub,
                  const MemberOptions& options, int64_t incarnation)
      : connection_(std::move(connection)),
        stub_(std::move(stub)),
        options_(options),
        incarnation_(incarnation),
        heartbeat_([this] { HeartbeatLoop(); }) {}

  ~GrpcGroupMember() override { Leave().IgnoreError(); }

  int64_t incarnation() const override { return incarnation_; }

  absl::Status health() const override {
    absl::MutexLock lock(&mu_);
    return health_;
  }

  absl::Status Barrier(const std::string& barrier_id, absl::Duration timeout,
                       const std::vector<std::string>& participants) override {
    v1::BarrierRequest req;
    req.set_group(options_.group);
    req.set_barrier_id(barrier_id);
    req.set_name(options_.name);
    req.set_incarnation(incarnation_);
    for (const std::string& p : participants) req.add_participants(p);
    req.set_timeout_ms(ToMillis(timeout));
    v1::BarrierResponse resp;
    return connection_->Call(absl::StrCat("barrier '", barrier_id, "'"),
                             CallOptions::Once(timeout + kServerTimeoutSlack),
                             stub_.get(), &v1::Membership::Stub::Barrier, req,
                             &resp);
  }

  absl::Status ReportError(const std::string& message) override {
    v1::ReportErrorRequest req;
    req.set_group(options_.group);
    req.set_name(options_.name);
    req.set_incarnation(incarnation_);
    req.set_message(message);
    v1::ReportErrorResponse resp;
    return connection_->Call(
        "report error",
        CallOptions::Retryable(connection_->options().rpc_timeout), stub_.get(),
        &v1::Membership::Stub::ReportError, req, &resp);
  }

  absl::Status Leave() override {
    {
      absl::MutexLock lock(&mu_);
      if (left_) return absl::OkStatus();
      left_ = true;
    }
    heartbeat_.join();
    v1::LeaveGroupRequest req;
    req.set_group(options_.group);
    req.set_name(options_.name);
    req.set_incarnation(incarnation_);
    v1::LeaveGroupResponse resp;
    return connection_->Call(
        "leave group",
        CallOptions::Retryable(connection_->options().rpc_timeout), stub_.get(),
        &v1::Membership::Stub::LeaveGroup, req, &resp);
  }

 private:
  void HeartbeatLoop() {
    const absl::Duration lease =
        options_.heartbeat_interval * options_.missed_heartbeats;
    absl::Time last_ok = absl::Now();
    absl::MutexLock lock(&mu_);
    for (;;) {
      if (mu_.AwaitWithTimeout(absl::Condition(&left_),
                               options_.heartbeat_interval)) {
        return;
      }
      mu_.Unlock();
      v1::HeartbeatRequest req;
      req.set_group(options_.group);
      req.set_name(options_.name);
      req.set_incarnation(incarnation_);
      v1::HeartbeatResponse resp;
      grpc::ClientContext context;
      connection_->Prepare(&context);
      // Wait for a reconnection (cohortd restarting) rather than failing
      // fast; the next heartbeat is due after one interval anyway.
      context.set_wait_for_ready(true);
      context.set_deadline(
          absl::ToChronoTime(absl::Now() + options_.heartbeat_interval));
      grpc::Status status = stub_->Heartbeat(&context, req, &resp);
      mu_.Lock();
      if (status.ok()) {
        last_ok = absl::Now();
        continue;
      }
      if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
        health_ = connection_->Explain("membership", status, 1);
        return;
      }
      if (absl::Now() - last_ok > lease) {
        // Still trying, but cohortd will have declared us failed by now.
        health_ = connection_->Explain(
            absl::StrCat("no heartbeat reached cohortd for ",
                         absl::FormatDuration(lease)),
            status, 1);
      }
    }
  }

  const std::shared_ptr<Connection> connection_;
  const std::shared_ptr<v1::Membership::Stub> stub_;
  const MemberOptions options_;
  const int64_t incarnation_;
  mutable absl::Mutex mu_;
  bool left_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  std::thread heartbeat_;  // Last: starts once the rest is built.
};

class GrpcMemberWatch final : public MemberWatch {
 public:
  GrpcMemberWatch(std::shared_ptr<Connection> connection,
                  std::shared_ptr<v1::Membership::Stub> stub,
                  const std::string& group, MemberEventCallback callback)
      : stream_(
            std::move(connection), "member watch", 0,
            [stub, group](grpc::ClientContext* context, int64_t from) {
              v1::WatchMembersRequest req;
              req.set_group(group);
              req.set_from_revision(from);
              return stub->WatchMembers(context, req);
            },
            [callback = std::move(callback)](const v1::MemberEvent& e) {
              callback(ToEvent(e));
            }) {}

  void Cancel() override { stream_.Cancel(); }
  absl::Status Wait() override { return stream_.Wait(); }
  absl::Status WaitStarted() { return stream_.WaitStarted(); }

 private:
  ResumingStream<v1::WatchMembersResponse> stream_;
};

class GrpcMembershipClient final : public MembershipClient {
 public:
  explicit GrpcMembershipClient(std::shared_ptr<Connection> connection)
      : connection_(std::move(connection)),
        stub_(v1::Membership::NewStub(connection_->channel())) {}

  absl::StatusOr<std::unique_ptr<GroupMember>> JoinGroup(
      const MemberOptions& options) override {
    if (options.heartbeat_interval <= absl::ZeroDuration() ||
        options.missed_heartbeats < 1) {
      return absl::InvalidArgumentError(
          "heartbeat_interval must be > 0 and missed_heartbeats >= 1");
    }
    v1::JoinGroupRequest req;
    req.set_group(options.group);
    req.set_name(options.name);
    req.set_rank(options.rank);
    req.set_host(options.host);
    req.set_heartbeat_interval_ms(ToMillis(options.heartbeat_interval));
    req.set_missed_heartbeats(options.missed_heartbeats);
    v1::JoinGroupResponse resp;
    if (absl::Status s = connection_->Call(
            "join group", CallOptions::Once(connection_->options().rpc_timeout),
            stub_.get(), &v1::Membership::Stub::JoinGroup, req, &resp);
        !s.ok()) {
      return s;
    }
    return std::make_unique<GrpcGroupMember>(connection_, stub_, options,
                                             resp.incarnation());
  }

  absl::StatusOr<std::vector<Member>> ListMembers(
      const std::string& group) override {
    v1::ListMembersRequest req;
    req.set_group(group);
    v1::ListMembersResponse resp;
    if (absl::Status s = connection_->Call(
            "list members",
            CallOptions::Retryable(connection_->options().rpc_timeout),
            stub_.get(), &v1::Membership::Stub::ListMembers, req, &resp);
        !s.ok()) {
      return s;
    }
    std::vector<Member> members;
    for (const v1::MemberInfo& info : resp.members()) {
      members.push_back(ToMember(info));
    }
    return members;
  }

  absl::StatusOr<std::unique_ptr<MemberWatch>> Watch(
      const std::string& group, MemberEventCallback callback) override {
    auto watch = std::make_unique<GrpcMemberWatch>(connection_, stub_, group,
                                                   std::move(callback));
    if (absl::Status s = watch->WaitStarted(); !s.ok()) return s;
    return watch;
  }

 private:
  std::shared_ptr<Connection> connection_;
  std::shared_ptr<v1::Membership::Stub> stub_;
};

}  // namespace

absl::Status ReportMemberError(const ConnectionOptions& connection,
                               const std::string& group,
                               const std::string& name, int64_t incarnation,
                               const std::string& message) {
  absl::StatusOr<std::shared_ptr<Connection>> opened =
      Connection::Open(connection);
  if (!opened.ok()) return opened.status();
  std::unique_ptr<v1::Membership::Stub> stub =
      v1::Membership::NewStub((*opened)->channel());
  v1::ReportErrorRequest req;
  req.set_group(group);
  req.set_name(name);
  req.set_incarnation(incarnation);
  req.set_message(message);
  v1::ReportErrorResponse resp;
  return (*opened)->Call(
      "report error", CallOptions::Retryable(connection.rpc_timeout),
      stub.get(), &v1::Membership::Stub::ReportError, req, &resp);
}

absl::StatusOr<std::unique_ptr<MembershipClient>> MembershipClient::Connect(
    const ConnectionOptions& connection) {
  absl::StatusOr<std::shared_ptr<Connection>> opened =
      Connection::Open(connection);
  if (!opened.ok()) return opened.status();
  return std::make_unique<GrpcMembershipClient>(std::move(*opened));
}

}  // namespace cohort

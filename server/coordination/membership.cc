#include "server/coordination/membership.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/text.h"
#include "server/coordination/records.h"

namespace cohort::server {
namespace {

// In c10d::kReservedPrefix, which clients cannot write.
constexpr absl::string_view kGroupsPrefix = "/cohort/groups/";
constexpr absl::Duration kDefaultInterval = absl::Seconds(5);
constexpr int kDefaultMissed = 3;
constexpr absl::Duration kDefaultBarrierTimeout = absl::Seconds(300);

absl::Status ValidateId(absl::string_view what, absl::string_view id) {
  if (id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must not be empty"));
  }
  if (absl::StrContains(id, '/') || id.size() > 512) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", base::Escape(id, 64),
                     "' must be at most 512 bytes and contain no '/'"));
  }
  return absl::OkStatus();
}

absl::Duration LeaseTimeout(const v1::MemberInfo& info) {
  return absl::Milliseconds(info.heartbeat_interval_ms()) *
         info.missed_heartbeats();
}

}  // namespace

std::string Membership::MembersPrefix(absl::string_view group) {
  return absl::StrCat(kGroupsPrefix, group, "/members/");
}

bool Membership::DecodeEvent(const store::Event& event, v1::MemberEvent* out) {
  if (event.type != store::Event::Type::kPut || !event.value ||
      !out->ParseFromString(*event.value)) {
    return false;
  }
  out->set_revision(event.revision);
  return true;
}

Membership::Membership(store::KvStore* store, absl::Duration sweep_period)
    : store_(store), sweep_period_(sweep_period) {
  // Reload the members recorded before a restart, each with a fresh lease:
  // they had no way to heartbeat while cohortd was down.
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    LoadRecords<v1::MemberEvent>(
        *store_, kGroupsPrefix,
        [&](absl::string_view name, v1::MemberEvent& record) {
          // name: GROUP/members/MEMBER
          const absl::string_view group = name.substr(0, name.find('/'));
          Live& live =
              groups_[std::string(group)].members[record.member().name()];
          live.group = std::string(group);
          live.info = std::move(*record.mutable_member());
          live.alive = record.type() == v1::MemberEvent::JOINED ||
                       record.type() == v1::MemberEvent::ERROR_REPORTED;
          live.last_event = record.type();
          live.message = record.message();
          live.deadline = now + LeaseTimeout(live.info);
          if (live.alive) leases_.emplace(live.deadline, &live);
          last_incarnation_ =
              std::max(last_incarnation_, live.info.incarnation());
        });
  }
  timer_.Schedule(now + sweep_period_, [this] { Sweep(); });
}

Membership::~Membership() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  Shutdown(absl::UnavailableError("cohortd is shutting down"));
}

absl::Status Membership::RecordLocked(const std::string& group,
                                      const v1::MemberInfo& member,
                                      v1::MemberEvent::Type type,
                                      const std::string& message) {
  v1::MemberEvent record;
  record.set_type(type);
  *record.mutable_member() = member;
  record.set_message(message);
  absl::Status written =
      store_
          ->Set(absl::StrCat(MembersPrefix(group), member.name()),
                record.SerializeAsString())
          .status();
  auto g = groups_.find(group);
  if (written.ok() && g != groups_.end()) {
    auto m = g->second.members.find(member.name());
    if (m != g->second.members.end() &&
        m->second.info.incarnation() == member.incarnation()) {
      m->second.last_event = type;
      m->second.message = message;
    }
  }
  return written;
}

std::string Membership::Describe(const std::string& group,
                                 const std::string& name) {
  auto g = groups_.find(group);
  if (g != groups_.end()) {
    auto m = g->second.members.find(name);
    if (m != g->second.members.end()) {
      const v1::MemberInfo& info = m->second.info;
      std::string who = info.rank() >= 0 ? absl::StrCat("rank ", info.rank())
                                         : base::Escape(info.name());
      if (!info.host().empty()) {
        absl::StrAppend(&who, " (", base::Escape(info.host()), ")");
      }
      return who;
    }
  }
  return base::Escape(name);
}

absl::StatusOr<Membership::Live*> Membership::FindLocked(
    const std::string& group, const std::string& name, int64_t incarnation) {
  auto g = groups_.find(group);
  if (g != groups_.end()) {
    auto m = g->second.members.find(name);
    if (m != g->second.members.end() && m->second.alive &&
        m->second.info.incarnation() == incarnation) {
      return &m->second;
    }
  }
  return absl::NotFoundError(absl::StrCat(
      "'", base::Escape(name), "' (incarnation ", incarnation,
      ") is not a live member of '", base::Escape(group),
      "': it left, was declared failed or was replaced; join again"));
}

void Membership::RenewLocked(Live& live, absl::Time deadline) {
  leases_.erase({live.deadline, &live});
  live.deadline = deadline;
  leases_.emplace(deadline, &live);
}

void Membership::EndLocked(Live& live) {
  leases_.erase({live.deadline, &live});
  live.alive = false;
}

absl::StatusOr<v1::JoinGroupResponse> Membership::Join(
    const v1::JoinGroupRequest& req) {
  if (absl::Status s = ValidateId("group", req.group()); !s.ok()) return s;
  if (absl::Status s = ValidateId("member name", req.name()); !s.ok()) return s;
  if (req.heartbeat_interval_ms() < 0 || req.missed_heartbeats() < 0) {
    return absl::InvalidArgumentError(
        "heartbeat_interval_ms and missed_heartbeats must be >= 0 (0: "
        "default)");
  }
  v1::MemberInfo info;
  info.set_name(req.name());
  info.set_rank(req.rank());
  info.set_host(req.host());
  info.set_heartbeat_interval_ms(
      req.heartbeat_interval_ms() > 0
          ? req.heartbeat_interval_ms()
          : absl::ToInt64Milliseconds(kDefaultInterval));
  info.set_missed_heartbeats(
      req.missed_heartbeats() > 0 ? req.missed_heartbeats() : kDefaultMissed);
  Deferred deferred;
  v1::JoinGroupResponse resp;
  {
    absl::MutexLock lock(&mu_);
    // Unique across restarts too: time-based, and above any seen before.
    last_incarnation_ =
        std::max(last_incarnation_ + 1, absl::ToUnixMicros(absl::Now()));
    info.set_incarnation(last_incarnation_);
    Group& group = groups_[req.group()];
    auto old = group.members.find(req.name());
    if (old != group.members.end() && old->second.alive) {
      const std::string why = "replaced by a new incarnation (restarted)";
      EndLocked(old->second);
      ++members_failed_;
      if (absl::Status s = RecordLocked(req.group(), old->second.info,
                                        v1::MemberEvent::FAILED, why);
          !s.ok()) {
        return s;
      }
      AbortBarriersLocked(group, req.group(), req.name(),
                          absl::StrCat("failed: ", why), deferred);
    }
    if (absl::Status s =
            RecordLocked(req.group(), info, v1::MemberEvent::JOINED, "");
        !s.ok()) {
      return s;
    }
    // Any earlier incarnation is no longer alive, so holds no lease.
    Live& live = group.members[req.name()];
    live = Live{req.group(), info, absl::Now() + LeaseTimeout(info), true};
    leases_.emplace(live.deadline, &live);
    resp.set_incarnation(info.incarnation());
    resp.set_revision(store_->revision());
  }
  for (auto& fn : deferred) fn();
  return resp;
}

absl::Status Membership::Heartbeat(const v1::HeartbeatRequest& req) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Live*> live =
      FindLocked(req.group(), req.name(), req.incarnation());
  if (!live.ok()) return live.status();
  RenewLocked(**live, absl::Now() + LeaseTimeout((*live)->info));
  return absl::OkStatus();
}

absl::Status Membership::Leave(const v1::LeaveGroupRequest& req) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Live*> live =
        FindLocked(req.group(), req.name(), req.incarnation());
    if (!live.ok()) return absl::OkStatus();  // Already gone: idempotent.
    EndLocked(**live);
    if (absl::Status s = RecordLocked(req.group(), (*live)->info,
                                      v1::MemberEvent::LEFT, "left the group");
        !s.ok()) {
      return s;
    }
    AbortBarriersLocked(groups_[req.group()], req.group(), req.name(),
                        "left the group", deferred);
  }
  for (auto& fn : deferred) fn();
  return absl::OkStatus();
}

absl::Status Membership::ReportError(const v1::ReportErrorRequest& req) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Live*> live =
        FindLocked(req.group(), req.name(), req.incarnation());
    if (!live.ok()) return live.status();
    if (absl::Status s =
            RecordLocked(req.group(), (*live)->info,
                         v1::MemberEvent::ERROR_REPORTED, req.message());
        !s.ok()) {
      return s;
    }
    AbortBarriersLocked(
        groups_[req.group()], req.group(), req.name(),
        absl::StrCat("reported an error: ", base::Escape(req.message(), 4096)),
        deferred);
  }
  for (auto& fn : deferred) fn();
  return absl::OkStatus();
}

absl::StatusOr<v1::ListMembersResponse> Membership::List(
    const v1::ListMembersRequest& req) {
  if (absl::Status s = ValidateId("group", req.group()); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  v1::ListMembersResponse resp;
  auto g = groups_.find(req.group());
  if (g != groups_.end()) {
    const absl::Time now = absl::Now();
    for (const auto& [name, live] : g->second.members) {
      if (!live.alive) continue;
      v1::MemberInfo* info = resp.add_members();
      *info = live.info;
      // The lease runs LeaseTimeout from the last renewal.
      const absl::Time renewed = live.deadline - LeaseTimeout(live.info);
      info->set_heartbeat_age_ms(
          std::max<int64_t>(0, absl::ToInt64Milliseconds(now - renewed)));
    }
  }
  resp.set_revision(store_->revision());
  return resp;
}

void Membership::Sweep() {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    const absl::Time now = absl::Now();
    while (!leases_.empty() && leases_.begin()->first <= now) {
      Live& live = *leases_.begin()->second;
      EndLocked(live);
      ++members_failed_;
      const std::string why = absl::StrCat(
          "no heartbeat for ", absl::FormatDuration(LeaseTimeout(live.info)),
          " (", live.info.missed_heartbeats(), " intervals of ",
          absl::FormatDuration(
              absl::Milliseconds(live.info.heartbeat_interval_ms())),
          ")");
      RecordLocked(live.group, live.info, v1::MemberEvent::FAILED, why)
          .IgnoreError();
      AbortBarriersLocked(groups_[live.group], live.group, live.info.name(),
                          absl::StrCat("failed: ", why), deferred);
    }
    timer_.Schedule(now + sweep_period_, [this] { Sweep(); });
  }
  for (auto& fn : deferred) fn();
}

namespace {

absl::Status ValidateBarrier(const v1::BarrierRequest& req) {
  for (auto [what, id] :
       {std::pair<const char*, const std::string*>{"group", &req.group()},
        {"barrier_id", &req.barrier_id()},
        {"member name", &req.name()}}) {
    if (absl::Status s = ValidateId(what, *id); !s.ok()) return s;
  }
  if (req.timeout_ms() < 0) {
    return absl::InvalidArgumentError("timeout_ms must be >= 0 (0: 300 s)");
  }
  return absl::OkStatus();
}

}  // namespace

Membership::BarrierId Membership::Barrier(const v1::BarrierRequest& req,
                                          BarrierCallback done) {
  if (absl::Status s = ValidateBarrier(req); !s.ok()) {
    done(s);
    return 0;
  }
  const absl::Duration timeout = req.timeout_ms() > 0
                                     ? absl::Milliseconds(req.timeout_ms())
                                     : kDefaultBarrierTimeout;
  Deferred deferred;
  BarrierId id = 0;
  {
    absl::MutexLock lock(&mu_);
    absl::Status error = shutdown_;
    if (error.ok()) {
      error = FindLocked(req.group(), req.name(), req.incarnation()).status();
    }
    if (!error.ok()) {
      deferred.push_back([done, error] { done(error); });
    } else {
      id = ArriveLocked(req, timeout, std::move(done), deferred);
    }
  }
  for (auto& fn : deferred) fn();
  return id;
}

Membership::BarrierId Membership::ArriveLocked(const v1::BarrierRequest& req,
                                               absl::Duration timeout,
                                               BarrierCallback done,
                                               Deferred& deferred) {
  Group& group = groups_[req.group()];
  auto [it, created] = group.barriers.try_emplace(req.barrier_id());
  PendingBarrier& barrier = it->second;
  // Per arrival the work is O(log N) plus reading the participants it
  // names (each arrival sends them): a list sent as an earlier arrival
  // sent it is taken as it is, only another one is sorted.
  const auto& sent = req.participants();
  const bool as_before =
      !barrier.named_as.empty() &&
      std::equal(sent.begin(), sent.end(), barrier.named_as.begin(),
                 barrier.named_as.end());
  std::vector<std::string> named;
  if (!sent.empty() && !as_before) {
    named.assign(sent.begin(), sent.end());
    std::sort(named.begin(), named.end());
    named.erase(std::unique(named.begin(), named.end()), named.end());
  }
  if (created) StartBarrierLocked(group, req, named, timeout, barrier);
  BarrierId id = 0;
  if (absl::Status rejected = CheckArrivalLocked(req, named, barrier);
      !rejected.ok()) {
    deferred.push_back([done, rejected] { done(rejected); });
  } else {
    id = next_barrier_id_++;
    ++barrier_arrivals_;
    barrier.arrived.emplace(id, Arrival{req.name(), std::move(done)});
    ++barrier.here[req.name()];
    arrivals_.emplace(id, &barrier);
    // A participant already gone when the barrier starts can never
    // arrive; later failures abort it through AbortBarriersLocked.
    const std::string* gone =
        created ? GoneParticipantLocked(group, barrier) : nullptr;
    if (gone != nullptr) {
      FailBarrierLocked(group, req.barrier_id(),
                        absl::AbortedError(absl::StrCat(
                            "barrier '", base::Escape(req.barrier_id()),
                            "' aborted: ", Describe(req.group(), *gone),
                            " is not a live member")),
                        deferred);
      id = 0;
    } else if (barrier.here.size() == barrier.participants.size()) {
      EndBarrierLocked(group, it, barrier.generation, deferred);
      id = 0;
    }
  }
  if (created) {
    // Nobody waits on a barrier that only saw a rejected call.
    auto again = group.barriers.find(req.barrier_id());
    if (again != group.barriers.end() && again->second.arrived.empty()) {
      timer_.Cancel(again->second.timer);
      group.barriers.erase(again);
      --group.generations[req.barrier_id()];
    }
  }
  return id;
}

void Membership::StartBarrierLocked(Group& group, const v1::BarrierRequest& req,
                                    const std::vector<std::string>& named,
                                    absl::Duration timeout,
                                    PendingBarrier& barrier) {
  barrier.generation = ++group.generations[req.barrier_id()];
  barrier.participants = named;
  if (barrier.participants.empty()) {
    for (const auto& [name, live] : group.members) {
      if (live.alive) barrier.participants.push_back(name);
    }
  }
  barrier.started = absl::Now();
  barrier.timeout = timeout;
  const std::string group_name = req.group(), barrier_id = req.barrier_id();
  const int64_t generation = barrier.generation;
  barrier.timer = timer_.Schedule(
      absl::Now() + timeout, [this, group_name, barrier_id, generation] {
        OnBarrierTimeout(group_name, barrier_id, generation);
      });
}

absl::Status Membership::CheckArrivalLocked(
    const v1::BarrierRequest& req, const std::vector<std::string>& named,
    PendingBarrier& barrier) {
  auto escape = [](const std::string& name) { return base::Escape(name); };
  if (!named.empty() && named != barrier.participants) {
    return absl::InvalidArgumentError(absl::StrCat(
        "barrier '", base::Escape(req.barrier_id()),
        "' was started with participants [",
        base::FirstFew(barrier.participants.begin(), barrier.participants.end(),
                       16, escape),
        "], not [", base::FirstFew(named.begin(), named.end(), 16, escape),
        "]"));
  }
  if (!std::binary_search(barrier.participants.begin(),
                          barrier.participants.end(), req.name())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "'", base::Escape(req.name()), "' is not a participant of barrier '",
        base::Escape(req.barrier_id()), "'"));
  }
  if (!named.empty() && barrier.named_as.empty()) {
    barrier.named_as.assign(req.participants().begin(),
                            req.participants().end());
  }
  return absl::OkStatus();
}

const std::string* Membership::GoneParticipantLocked(
    const Group& group, const PendingBarrier& barrier) {
  for (const std::string& name : barrier.participants) {
    auto m = group.members.find(name);
    if (m == group.members.end() || !m->second.alive) return &name;
  }
  return nullptr;
}

void Membership::CancelBarrier(BarrierId id) {
  absl::MutexLock lock(&mu_);
  auto where = arrivals_.find(id);
  if (where == arrivals_.end()) return;
  PendingBarrier& barrier = *where->second;
  arrivals_.erase(where);
  auto arrival = barrier.arrived.find(id);
  auto here = barrier.here.find(arrival->second.name);
  if (--here->second == 0) barrier.here.erase(here);
  barrier.arrived.erase(arrival);
}

void Membership::EndBarrierLocked(
    Group& group, std::map<std::string, PendingBarrier>::iterator it,
    const absl::StatusOr<int64_t>& result, Deferred& deferred) {
  PendingBarrier& barrier = it->second;
  timer_.Cancel(barrier.timer);
  deferred.reserve(deferred.size() + barrier.arrived.size());
  for (auto& [id, arrival] : barrier.arrived) {
    arrivals_.erase(id);
    deferred.push_back(
        [done = std::move(arrival.done), result] { done(result); });
  }
  group.barriers.erase(it);
}

void Membership::FailBarrierLocked(Group& group, const std::string& barrier_id,
                                   const absl::Status& status,
                                   Deferred& deferred) {
  auto it = group.barriers.find(barrier_id);
  if (it == group.barriers.end()) return;
  EndBarrierLocked(group, it, status, deferred);
}

void Membership::AbortBarriersLocked(Group& group,
                                     const std::string& group_name,
                                     const std::string& name,
                                     const std::string& why,
                                     Deferred& deferred) {
  std::vector<std::string> affected;
  for (const auto& [barrier_id, barrier] : group.barriers) {
    if (std::binary_search(barrier.participants.begin(),
                           barrier.participants.end(), name)) {
      affected.push_back(barrier_id);
    }
  }
  for (const std::string& barrier_id : affected) {
    FailBarrierLocked(group, barrier_id,
                      absl::AbortedError(absl::StrCat(
                          "barrier '", base::Escape(barrier_id),
                          "' aborted: ", Describe(group_name, name), " ", why)),
                      deferred);
  }
}

void Membership::OnBarrierTimeout(const std::string& group_name,
                                  const std::string& barrier_id,
                                  int64_t generation) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    Group& group = groups_[group_name];
    auto it = group.barriers.find(barrier_id);
    if (it == group.barriers.end() || it->second.generation != generation) {
      return;
    }
    const PendingBarrier& barrier = it->second;
    std::vector<std::string> missing;
    for (const std::string& name : barrier.participants) {
      if (!barrier.here.contains(name)) {
        missing.push_back(Describe(group_name, name));
      }
    }
    const size_t n = barrier.participants.size();
    ++barrier_timeouts_;
    FailBarrierLocked(
        group, barrier_id,
        absl::DeadlineExceededError(absl::StrCat(
            "barrier '", base::Escape(barrier_id), "' timed out after ",
            absl::FormatDuration(barrier.timeout), ": ", n - missing.size(),
            "/", n, " arrived; missing: ", base::ListSome(missing))),
        deferred);
  }
  for (auto& fn : deferred) fn();
}

void Membership::Shutdown(absl::Status status) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (!shutdown_.ok()) return;
    shutdown_ = status;
    for (auto& [group_name, group] : groups_) {
      std::vector<std::string> ids;
      for (const auto& [barrier_id, barrier] : group.barriers) {
        ids.push_back(barrier_id);
      }
      for (const std::string& barrier_id : ids) {
        FailBarrierLocked(group, barrier_id, status, deferred);
      }
    }
  }
  for (auto& fn : deferred) fn();
}

MembershipStats Membership::stats() {
  absl::MutexLock lock(&mu_);
  MembershipStats stats;
  stats.members_alive = leases_.size();
  stats.members_failed = members_failed_;
  stats.barrier_arrivals = barrier_arrivals_;
  stats.barrier_timeouts = barrier_timeouts_;
  stats.barrier_waiting = arrivals_.size();
  return stats;
}

std::vector<std::string> Membership::GroupNames() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  names.reserve(groups_.size());
  for (const auto& [name, group] : groups_) {
    if (!group.members.empty()) names.push_back(name);
  }
  return names;
}

absl::StatusOr<GroupSnapshot> Membership::Snapshot(const std::string& group,
                                                   size_t max_listed) {
  absl::MutexLock lock(&mu_);
  auto g = groups_.find(group);
  if (g == groups_.end() || g->second.members.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no group '", base::Escape(group), "'"));
  }
  GroupSnapshot out;
  out.group = group;
  out.members = g->second.members.size();
  for (const auto& [name, live] : g->second.members) {
    if (live.alive) ++out.alive;
    if (out.listed.size() < max_listed) {
      out.listed.push_back({.info = live.info,
                            .alive = live.alive,
                            .last_event = live.last_event,
                            .message = live.message,
                            .lease_end = live.deadline});
    }
  }
  for (const auto& [id, barrier] : g->second.barriers) {
    BarrierSnapshot b{.id = id,
                      .generation = barrier.generation,
                      .participants = barrier.participants.size(),
                      .arrived = barrier.here.size(),
                      .started = barrier.started,
                      .timeout = barrier.timeout};
    for (const std::string& name : barrier.participants) {
      if (barrier.here.contains(name)) continue;
      if (b.missing.size() == max_listed) {
        ++b.missing_unlisted;
        continue;
      }
      auto m = g->second.members.find(name);
      if (m != g->second.members.end()) {
        b.missing.push_back(m->second.info);
      } else {
        b.missing.emplace_back().set_name(name);
        b.missing.back().set_rank(-1);
      }
    }
    out.barriers.push_back(std::move(b));
  }
  return out;
}

}  // namespace cohort::server

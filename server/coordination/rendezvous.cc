#include "server/coordination/rendezvous.h"

#include <algorithm>
#include <iterator>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/text.h"
#include "server/coordination/records.h"

namespace cohort::server {
namespace {

// In c10d::kReservedPrefix, which clients cannot write.
constexpr absl::string_view kRunsPrefix = "/cohort/runs/";
constexpr int kDefaultParticipantsPage = 1000;
constexpr int kMaxParticipantsPage = 10000;
constexpr int kMaxRanges = 64;
// The participants one ListParticipants or GetParticipants reply carries,
// in bytes: below gRPC's default 4 MiB message limit with room for the
// reply's other fields.
constexpr size_t kMaxReplyBytes = (4 << 20) - 1024;
constexpr absl::Duration kDefaultJoinTimeout = absl::Seconds(600);
constexpr absl::Duration kDefaultLastCall = absl::Seconds(30);

// Bounds that keep every rank an int32 with room to spare.
constexpr int32_t kMaxLocalWorldSize = 1 << 16;
constexpr int64_t kMaxWorldSize = 1 << 24;

absl::Status ValidateRequest(const v1::JoinRequest& req) {
  for (auto [what, id] :
       {std::pair<const char*, const std::string*>{"run_id", &req.run_id()},
        {"node_id", &req.node_id()}}) {
    if (id->empty() || absl::StrContains(*id, '/') || id->size() > 512) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " '", base::Escape(*id, 64),
                       "' must be 1 to 512 bytes with no '/'"));
    }
  }
  if (req.local_world_size() < 1 ||
      req.local_world_size() > kMaxLocalWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("local_world_size must be 1 to ", kMaxLocalWorldSize,
                     ", got ", req.local_world_size()));
  }
  if (req.min_nodes() < 1 || req.max_nodes() < req.min_nodes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "need 1 <= min_nodes <= max_nodes, got min_nodes=", req.min_nodes(),
        " max_nodes=", req.max_nodes()));
  }
  if (req.join_timeout_ms() < 0 || req.last_call_timeout_ms() < 0) {
    return absl::InvalidArgumentError(
        "join_timeout_ms and last_call_timeout_ms must be >= 0 (0: default)");
  }
  return absl::OkStatus();
}

// The first 16 node ids of `collecting`, then "and N more": a timeout
// message that costs the same at any number of nodes.
template <typename Collecting>
std::string FirstNodes(const Collecting& collecting) {
  constexpr size_t kShown = 16;
  auto end = collecting.begin();
  std::advance(end, std::min(kShown, collecting.size()));
  std::string text =
      base::FirstFew(collecting.begin(), end, kShown,
                     [](const auto& node) { return base::Escape(node.first); });
  if (collecting.size() > kShown) {
    absl::StrAppend(&text, " and ", collecting.size() - kShown, " more");
  }
  return text;
}

template <typename Response>
absl::StatusOr<Response> Parse(absl::StatusOr<ParticipantsReply> reply) {
  if (!reply.ok()) return reply.status();
  Response resp;
  if (!resp.ParseFromString(reply->Flatten())) {
    return absl::InternalError("a participants reply did not parse");
  }
  return resp;
}

}  // namespace

std::string Rendezvous::RunKey(absl::string_view run_id) {
  return absl::StrCat(kRunsPrefix, run_id);
}

Rendezvous::Rendezvous(store::KvStore* store) : store_(store) {
  absl::MutexLock lock(&mu_);
  LoadRecords<v1::RunState>(
      *store_, kRunsPrefix,
      [&](absl::string_view run_id, v1::RunState& record) {
        auto it = runs_.try_emplace(std::string(run_id)).first;
        Run& run = it->second;
        run.id = &it->first;
        run.record = std::move(record);
        run.has_completed = run.record.phase() == v1::RunState::COMPLETE ||
                            run.record.participants_size() > 0;
        if (run.has_completed) {
          run.list = std::make_shared<const ParticipantList>(
              run.record.round(), run.record.participants());
        }
      });
}

Rendezvous::~Rendezvous() {
  Shutdown(absl::UnavailableError("cohortd is shutting down"));
}

Rendezvous::JoinId Rendezvous::Join(const v1::JoinRequest& req,
                                    JoinCallback done) {
  if (absl::Status s = ValidateRequest(req); !s.ok()) {
    done(s);
    return 0;
  }
  Deferred deferred;
  JoinId id = 0;
  {
    absl::MutexLock lock(&mu_);
    auto [it, created] = runs_.try_emplace(req.run_id());
    Run& run = it->second;
    if (created) {
      run.id = &it->first;
      run.record.set_phase(v1::RunState::COLLECTING);
      run.record.set_min_nodes(req.min_nodes());
      run.record.set_max_nodes(req.max_nodes());
      run.record.set_last_call_timeout_ms(
          req.last_call_timeout_ms() > 0
              ? req.last_call_timeout_ms()
              : absl::ToInt64Milliseconds(kDefaultLastCall));
    }
    // A second join from the same node while collecting is a retry: the
    // newer call replaces the older, which is told so.
    auto old = run.collecting.find(req.node_id());
    const absl::Status error = CheckJoinLocked(req, run, old);
    if (!error.ok()) {
      deferred.push_back([done = std::move(done), error] { done(error); });
    } else {
      if (old != run.collecting.end()) {
        deferred.push_back([replaced = RemoveLocked(run, old)] {
          replaced(absl::AbortedError(
              "replaced by a newer join from the same node_id"));
        });
      }
      id = next_id_++;
      auto pending_it = run.collecting.try_emplace(req.node_id()).first;
      Pending& pending = pending_it->second;
      pending.id = id;
      pending.node.set_node_id(req.node_id());
      pending.node.set_address(req.address());
      pending.node.set_local_world_size(req.local_world_size());
      pending.done = std::move(done);
      pending.timeout = req.join_timeout_ms() > 0
                            ? absl::Milliseconds(req.join_timeout_ms())
                            : kDefaultJoinTimeout;
      pending.timer = timer_.Schedule(absl::Now() + pending.timeout,
                                      [this, id] { OnJoinTimeout(id); });
      run.collecting_world += req.local_world_size();
      joins_.emplace(id, JoinRef{&run, pending_it});
      const int n = static_cast<int>(run.collecting.size());
      if (n >= run.record.max_nodes()) {
        CompleteLocked(run, deferred);
        id = 0;
      } else if (n >= run.record.min_nodes() && run.last_call == 0) {
        const int64_t round = CollectingRound(run);
        run.last_call = timer_.Schedule(
            absl::Now() + absl::Milliseconds(run.record.last_call_timeout_ms()),
            [this, run_id = req.run_id(), round] {
              OnLastCall(run_id, round);
            });
      }
    }
  }
  for (auto& fn : deferred) fn();
  return id;
}

absl::Status Rendezvous::CheckJoinLocked(const v1::JoinRequest& req,
                                         const Run& run,
                                         Collecting::const_iterator old) {
  absl::Status error = shutdown_;
  if (error.ok() && run.record.phase() == v1::RunState::CLOSED) {
    error = absl::FailedPreconditionError(
        absl::StrCat("run '", base::Escape(req.run_id()), "' is closed"));
  }
  if (error.ok() && (req.min_nodes() != run.record.min_nodes() ||
                     req.max_nodes() != run.record.max_nodes())) {
    error = absl::FailedPreconditionError(
        absl::StrCat("run '", base::Escape(req.run_id()), "' has nodes ",
                     run.record.min_nodes(), ":", run.record.max_nodes(),
                     " but node '", base::Escape(req.node_id()), "' asked for ",
                     req.min_nodes(), ":", req.max_nodes()));
  }
  if (error.ok()) {
    int64_t world = run.collecting_world + req.local_world_size();
    if (old != run.collecting.end()) {
      world -= old->second.node.local_world_size();
    }
    if (world > kMaxWorldSize) {
      error = absl::InvalidArgumentError(absl::StrCat(
          "node '", base::Escape(req.node_id()), "' with local_world_size ",
          req.local_world_size(), " would make run '",
          base::Escape(req.run_id()), "' a world of ", world,
          " ranks, over the limit of ", kMaxWorldSize));
    }
  }
  return error;
}

Rendezvous::JoinCallback Rendezvous::RemoveLocked(Run& run,
                                                  Collecting::iterator it) {
  Pending& pending = it->second;
  timer_.Cancel(pending.timer);
  joins_.erase(pending.id);
  run.collecting_world -= pending.node.local_world_size();
  JoinCallback done = std::move(pending.done);
  run.collecting.erase(it);
  return done;
}

void Rendezvous::FailAllLocked(Run& run, const absl::Status& status,
                               Deferred& deferred) {
  node_visits_ += run.collecting.size();
  for (auto& [node_id, pending] : run.collecting) {
    timer_.Cancel(pending.timer);
    joins_.erase(pending.id);
    deferred.push_back(
        [done = std::move(pending.done), status] { done(status); });
  }
  run.collecting.clear();
  run.collecting_world = 0;
}

void Rendezvous::MaybeStopLastCallLocked(Run& run) {
  if (static_cast<int>(run.collecting.size()) < run.record.min_nodes() &&
      run.last_call != 0) {
    timer_.Cancel(run.last_call);
    run.last_call = 0;
  }
}

void Rendezvous::CompleteLocked(Run& run, Deferred& deferred) {
  if (run.last_call != 0) timer_.Cancel(run.last_call);
  run.last_call = 0;
  const int64_t round = CollectingRound(run);
  const int num_nodes = static_cast<int>(run.collecting.size());

  // Built afresh rather than copied from run.record, which still holds
  // the previous round's participants.
  v1::RunState record;
  record.set_round(round);
  record.set_phase(v1::RunState::COMPLETE);
  record.set_min_nodes(run.record.min_nodes());
  record.set_max_nodes(run.record.max_nodes());
  record.set_last_call_timeout_ms(run.record.last_call_timeout_ms());
  record.set_num_participants(num_nodes);
  record.mutable_participants()->Reserve(num_nodes);
  int node_rank = 0, world_size = 0;
  for (auto& [node_id, pending] : run.collecting) {
    pending.node.set_node_rank(node_rank++);
    pending.node.set_first_global_rank(world_size);
    world_size += pending.node.local_world_size();
    *record.add_participants() = std::move(pending.node);
  }
  node_visits_ += num_nodes;
  const std::string key = RunKey(*run.id);
  std::string value = record.SerializeAsString();
  bytes_serialized_ += value.size();
  if (absl::Status s = store_->Set(key, std::move(value)).status(); !s.ok()) {
    // Without the record the round is not durable: fail it, keep collecting.
    FailAllLocked(run, s, deferred);
    return;
  }
  auto list =
      std::make_shared<const ParticipantList>(round, record.participants());
  bytes_serialized_ += list->bytes();
  run.list = std::move(list);
  run.record = std::move(record);
  run.has_completed = true;
  ++rounds_completed_;

  const bool inline_list = num_nodes <= kMaxInlineParticipants;
  const std::string prefix = absl::StrCat("runs/", *run.id, "/", round);
  int rank = 0;
  for (auto& [node_id, pending] : run.collecting) {
    const v1::Participant& node = run.record.participants(rank++);
    timer_.Cancel(pending.timer);
    joins_.erase(pending.id);
    v1::JoinResponse resp;
    resp.set_round(round);
    resp.set_node_rank(node.node_rank());
    resp.set_num_nodes(num_nodes);
    resp.set_world_size(world_size);
    resp.set_first_global_rank(node.first_global_rank());
    if (inline_list) {
      *resp.mutable_participants() = run.record.participants();
    } else {
      resp.set_participants_key(key);
    }
    resp.set_store_prefix(prefix);
    join_response_bytes_ += resp.ByteSizeLong();
    deferred.push_back(
        [done = std::move(pending.done), resp = std::move(resp)]() mutable {
          done(std::move(resp));
        });
  }
  node_visits_ += num_nodes;
  run.collecting.clear();
  run.collecting_world = 0;
}

void Rendezvous::OnLastCall(const std::string& run_id, int64_t round) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(run_id);
    if (it == runs_.end()) return;
    Run& run = it->second;
    run.last_call = 0;
    if (CollectingRound(run) != round ||
        static_cast<int>(run.collecting.size()) < run.record.min_nodes()) {
      return;
    }
    CompleteLocked(run, deferred);
  }
  for (auto& fn : deferred) fn();
}

void Rendezvous::OnJoinTimeout(JoinId id) {
  JoinCallback done;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    auto ref = joins_.find(id);
    if (ref == joins_.end()) return;
    Run& run = *ref->second.run;
    const Collecting::iterator pending = ref->second.it;
    status = absl::DeadlineExceededError(absl::StrCat(
        "rendezvous of run '", base::Escape(*run.id), "' round ",
        CollectingRound(run), " timed out after ",
        absl::FormatDuration(pending->second.timeout), ": ",
        run.collecting.size(), " of min_nodes=", run.record.min_nodes(),
        " nodes arrived (", FirstNodes(run.collecting), ")"));
    done = RemoveLocked(run, pending);
    MaybeStopLastCallLocked(run);
  }
  done(status);
}

void Rendezvous::CancelJoin(JoinId id) {
  absl::MutexLock lock(&mu_);
  auto ref = joins_.find(id);
  if (ref == joins_.end()) return;
  Run& run = *ref->second.run;
  RemoveLocked(run, ref->second.it);
  MaybeStopLastCallLocked(run);
}

absl::StatusOr<v1::RunState> Rendezvous::GetRunState(
    const std::string& run_id) {
  v1::GetRunStateRequest req;
  req.set_run_id(run_id);
  return GetRunState(req);
}

absl::StatusOr<v1::RunState> Rendezvous::GetRunState(
    const v1::GetRunStateRequest& req) {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(req.run_id());
  if (it == runs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no run '", base::Escape(req.run_id()), "'"));
  }
  const Run& run = it->second;
  const bool list = !req.omit_participants();
  v1::RunState state;
  state.set_min_nodes(run.record.min_nodes());
  state.set_max_nodes(run.record.max_nodes());
  state.set_last_call_timeout_ms(run.record.last_call_timeout_ms());
  if (!run.has_completed && run.record.phase() != v1::RunState::CLOSED) {
    state.set_round(0);
    state.set_phase(v1::RunState::COLLECTING);
    state.set_num_participants(static_cast<int32_t>(run.collecting.size()));
    if (list) {
      for (const auto& [node_id, pending] : run.collecting) {
        *state.add_participants() = pending.node;
      }
    }
    return state;
  }
  state.set_round(run.record.round());
  state.set_phase(run.record.phase());
  state.set_num_participants(run.record.participants_size());
  if (list) *state.mutable_participants() = run.record.participants();
  state.set_num_waiting(run.record.phase() == v1::RunState::CLOSED
                            ? run.record.num_waiting()
                            : static_cast<int32_t>(run.collecting.size()));
  return state;
}

absl::StatusOr<std::shared_ptr<const ParticipantList>> Rendezvous::ListOf(
    const std::string& run_id) {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(run_id);
  if (it == runs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no run '", base::Escape(run_id), "'"));
  }
  if (it->second.list == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("run '", base::Escape(run_id),
                     "' has no completed round yet: its first round is "
                     "still collecting nodes"));
  }
  return it->second.list;
}

absl::StatusOr<ParticipantsReply> Rendezvous::ListParticipantsBytes(
    const v1::ListParticipantsRequest& req) {
  if (req.page_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size must be >= 0, got ", req.page_size()));
  }
  const int page_size =
      req.page_size() == 0
          ? kDefaultParticipantsPage
          : std::min<int>(req.page_size(), kMaxParticipantsPage);
  absl::StatusOr<std::shared_ptr<const ParticipantList>> list =
      ListOf(req.run_id());
  if (!list.ok()) return list.status();
  const int64_t round = (*list)->round();
  const int num_nodes = (*list)->num_nodes();
  // The token is "ROUND:OFFSET": the round the listing began at and the
  // node rank to continue from.
  int offset = 0;
  if (!req.page_token().empty()) {
    std::pair<absl::string_view, absl::string_view> parts =
        absl::StrSplit(req.page_token(), absl::MaxSplits(':', 1));
    int64_t token_round = 0;
    if (!absl::SimpleAtoi(parts.first, &token_round) ||
        !absl::SimpleAtoi(parts.second, &offset) || offset <= 0 ||
        offset >= num_nodes || token_round > round) {
      return absl::InvalidArgumentError(
          "page_token is not one that ListParticipants returned for this "
          "run: pass back the previous page's next_page_token");
    }
    if (token_round != round) {
      return absl::AbortedError(absl::StrCat(
          "run '", base::Escape(req.run_id()), "' completed round ", round,
          " while the participants of round ", token_round,
          " were being listed: list again"));
    }
  }
  ParticipantsReply reply;
  v1::ListParticipantsResponse tail;
  tail.set_round(round);
  tail.set_num_nodes(num_nodes);
  if (offset < num_nodes) {
    const int end = (*list)->PageEnd(offset, page_size, kMaxReplyBytes);
    reply.pieces.push_back((*list)->Entries(offset, end));
    if (end < num_nodes) {
      tail.set_next_page_token(absl::StrCat(round, ":", end));
    }
  }
  reply.tail = tail.SerializeAsString();
  reply.list = *std::move(list);
  return reply;
}

absl::StatusOr<v1::ListParticipantsResponse> Rendezvous::ListParticipants(
    const v1::ListParticipantsRequest& req) {
  return Parse<v1::ListParticipantsResponse>(ListParticipantsBytes(req));
}

absl::StatusOr<ParticipantsReply> Rendezvous::GetParticipantsBytes(
    const v1::GetParticipantsRequest& req) {
  if (req.ranges_size() == 0) {
    return absl::InvalidArgumentError(
        "ranges is empty: ask for at least one range of node ranks "
        "[start_node_rank, end_node_rank)");
  }
  if (req.ranges_size() > kMaxRanges) {
    return absl::InvalidArgumentError(
        absl::StrCat("GetParticipants takes at most ", kMaxRanges,
                     " ranges, got ", req.ranges_size()));
  }
  absl::StatusOr<std::shared_ptr<const ParticipantList>> list =
      ListOf(req.run_id());
  if (!list.ok()) return list.status();
  const int64_t round = (*list)->round();
  const int num_nodes = (*list)->num_nodes();
  if (req.has_round() && req.round() != round) {
    return absl::AbortedError(absl::StrCat(
        "run '", base::Escape(req.run_id()), "' has completed round ", round,
        ", not round ", req.round(), ": join again"));
  }
  ParticipantsReply reply;
  int64_t count = 0;
  size_t bytes = 0;
  for (int i = 0; i < req.ranges_size(); ++i) {
    const int32_t start = req.ranges(i).start_node_rank();
    const int32_t end = req.ranges(i).end_node_rank();
    if (start < 0 || start >= end || end > num_nodes) {
      return absl::InvalidArgumentError(
          absl::StrCat("range ", i, " [", start, ", ", end, ") of run '",
                       base::Escape(req.run_id()),
                       "' is not a non-empty range of its ", num_nodes,
                       " node ranks: need 0 <= start_node_rank < "
                       "end_node_rank <= ",
                       num_nodes, " (round ", round, ")"));
    }
    count += end - start;
    reply.pieces.push_back((*list)->Entries(start, end));
    bytes += reply.pieces.back().size();
  }
  if (count > kMaxParticipantsPage) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ranges ask for ", count, " participants, more than the ",
        kMaxParticipantsPage, " one call returns: split them over calls"));
  }
  if (bytes > kMaxReplyBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ranges ask for ", bytes, " bytes of participants, more than the ",
        kMaxReplyBytes, " one call returns: ask for fewer ranks a call"));
  }
  v1::GetParticipantsResponse tail;
  tail.set_round(round);
  tail.set_num_nodes(num_nodes);
  reply.tail = tail.SerializeAsString();
  reply.list = *std::move(list);
  return reply;
}

absl::StatusOr<v1::GetParticipantsResponse> Rendezvous::GetParticipants(
    const v1::GetParticipantsRequest& req) {
  return Parse<v1::GetParticipantsResponse>(GetParticipantsBytes(req));
}

absl::Status Rendezvous::CloseRun(const std::string& run_id) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(run_id);
    if (it == runs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("no run '", base::Escape(run_id), "'"));
    }
    Run& run = it->second;
    if (run.record.phase() == v1::RunState::CLOSED) return absl::OkStatus();
    v1::RunState record = run.record;
    record.set_phase(v1::RunState::CLOSED);
    std::string value = record.SerializeAsString();
    bytes_serialized_ += value.size();
    if (absl::Status s = store_->Set(RunKey(run_id), std::move(value)).status();
        !s.ok()) {
      return s;
    }
    run.record = std::move(record);
    if (run.last_call != 0) timer_.Cancel(run.last_call);
    run.last_call = 0;
    FailAllLocked(run,
                  absl::FailedPreconditionError(absl::StrCat(
                      "run '", base::Escape(run_id), "' was closed")),
                  deferred);
  }
  for (auto& fn : deferred) fn();
  return absl::OkStatus();
}

void Rendezvous::Shutdown(absl::Status status) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (!shutdown_.ok()) return;
    shutdown_ = status;
    for (auto& [run_id, run] : runs_) {
      if (run.last_call != 0) timer_.Cancel(run.last_call);
      run.last_call = 0;
      FailAllLocked(run, status, deferred);
    }
  }
  for (auto& fn : deferred) fn();
}

RendezvousStats Rendezvous::stats() {
  absl::MutexLock lock(&mu_);
  RendezvousStats stats;
  stats.rounds_completed = rounds_completed_;
  stats.runs = runs_.size();
  stats.waiting_nodes = joins_.size();
  stats.node_visits = node_visits_;
  stats.bytes_serialized = bytes_serialized_;
  stats.join_response_bytes = join_response_bytes_;
  return stats;
}

std::vector<std::string> Rendezvous::RunIds() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  ids.reserve(runs_.size());
  for (const auto& [id, run] : runs_) ids.push_back(id);
  return ids;
}

}  // namespace cohort::server

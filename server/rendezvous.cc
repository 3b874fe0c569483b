#include "server/rendezvous.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/text.h"
#include "server/records.h"

namespace cohort::server {
namespace {

// In c10d::kReservedPrefix, which clients cannot write.
constexpr absl::string_view kRunsPrefix = "/cohort/runs/";
constexpr int kDefaultParticipantsPage = 1000;
constexpr int kMaxParticipantsPage = 10000;
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

}  // namespace

std::string Rendezvous::RunKey(absl::string_view run_id) {
  return absl::StrCat(kRunsPrefix, run_id);
}

Rendezvous::Rendezvous(store::KvStore* store) : store_(store) {
  absl::MutexLock lock(&mu_);
  LoadRecords<v1::RunState>(
      *store_, kRunsPrefix,
      [&](absl::string_view run_id, v1::RunState& record) {
        Run& run = runs_[std::string(run_id)];
        run.record = std::move(record);
        run.has_completed = run.record.phase() == v1::RunState::COMPLETE ||
                            run.record.participants_size() > 0;
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
      run.record.set_phase(v1::RunState::COLLECTING);
      run.record.set_min_nodes(req.min_nodes());
      run.record.set_max_nodes(req.max_nodes());
      run.record.set_last_call_timeout_ms(
          req.last_call_timeout_ms() > 0
              ? req.last_call_timeout_ms()
              : absl::ToInt64Milliseconds(kDefaultLastCall));
    }
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
                       " but node '", base::Escape(req.node_id()),
                       "' asked for ", req.min_nodes(), ":", req.max_nodes()));
    }
    if (error.ok()) {
      int64_t world = req.local_world_size();
      for (const auto& [node_id, pending] : run.collecting) {
        if (node_id != req.node_id()) world += pending.node.local_world_size();
      }
      if (world > kMaxWorldSize) {
        error = absl::InvalidArgumentError(absl::StrCat(
            "node '", base::Escape(req.node_id()), "' with local_world_size ",
            req.local_world_size(), " would make run '",
            base::Escape(req.run_id()), "' a world of ", world,
            " ranks, over the limit of ", kMaxWorldSize));
      }
    }
    if (!error.ok()) {
      deferred.push_back([done = std::move(done), error] { done(error); });
    } else {
      // A second join from the same node while collecting is a retry:
      // the newer call replaces the older, which is told so.
      auto old = run.collecting.find(req.node_id());
      if (old != run.collecting.end()) {
        timer_.Cancel(old->second.timer);
        deferred.push_back([done = std::move(old->second.done)] {
          done(absl::AbortedError(
              "replaced by a newer join from the same node_id"));
        });
        run.collecting.erase(old);
      }
      id = next_id_++;
      Pending& pending = run.collecting[req.node_id()];
      pending.id = id;
      pending.node.set_node_id(req.node_id());
      pending.node.set_address(req.address());
      pending.node.set_local_world_size(req.local_world_size());
      pending.done = std::move(done);
      pending.timeout = req.join_timeout_ms() > 0
                            ? absl::Milliseconds(req.join_timeout_ms())
                            : kDefaultJoinTimeout;
      pending.timer =
          timer_.Schedule(absl::Now() + pending.timeout,
                          [this, run_id = req.run_id(), node_id = req.node_id(),
                           id] { OnJoinTimeout(run_id, node_id, id); });
      const int n = static_cast<int>(run.collecting.size());
      if (n >= run.record.max_nodes()) {
        CompleteLocked(req.run_id(), run, deferred);
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

void Rendezvous::CompleteLocked(const std::string& run_id, Run& run,
                                Deferred& deferred) {
  if (run.last_call != 0) timer_.Cancel(run.last_call);
  run.last_call = 0;
  const int64_t round = CollectingRound(run);

  v1::RunState record = run.record;
  record.set_round(round);
  record.set_phase(v1::RunState::COMPLETE);
  record.clear_participants();
  record.set_num_waiting(0);
  int node_rank = 0, world_size = 0;
  for (auto& [node_id, pending] : run.collecting) {
    timer_.Cancel(pending.timer);
    pending.node.set_node_rank(node_rank++);
    pending.node.set_first_global_rank(world_size);
    world_size += pending.node.local_world_size();
    *record.add_participants() = pending.node;
  }
  const std::string key = RunKey(run_id);
  if (absl::Status s = store_->Set(key, record.SerializeAsString()).status();
      !s.ok()) {
    // Without the record the round is not durable: fail it, keep collecting.
    for (auto& [node_id, pending] : run.collecting) {
      deferred.push_back([done = std::move(pending.done), s] { done(s); });
    }
    run.collecting.clear();
    return;
  }
  run.record = record;
  run.has_completed = true;
  ++rounds_completed_;

  const bool inline_list = record.participants_size() <= kMaxInlineParticipants;
  const std::string prefix = absl::StrCat("runs/", run_id, "/", round);
  for (auto& [node_id, pending] : run.collecting) {
    v1::JoinResponse resp;
    resp.set_round(round);
    resp.set_node_rank(pending.node.node_rank());
    resp.set_num_nodes(record.participants_size());
    resp.set_world_size(world_size);
    resp.set_first_global_rank(pending.node.first_global_rank());
    if (inline_list) {
      *resp.mutable_participants() = record.participants();
    } else {
      resp.set_participants_key(key);
    }
    resp.set_store_prefix(prefix);
    deferred.push_back(
        [done = std::move(pending.done), resp = std::move(resp)]() mutable {
          done(std::move(resp));
        });
  }
  run.collecting.clear();
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
    CompleteLocked(run_id, run, deferred);
  }
  for (auto& fn : deferred) fn();
}

void Rendezvous::OnJoinTimeout(const std::string& run_id,
                               const std::string& node_id, JoinId id) {
  JoinCallback done;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(run_id);
    if (it == runs_.end()) return;
    Run& run = it->second;
    auto pending = run.collecting.find(node_id);
    if (pending == run.collecting.end() || pending->second.id != id) return;
    status = absl::DeadlineExceededError(absl::StrCat(
        "rendezvous of run '", base::Escape(run_id), "' round ",
        CollectingRound(run), " timed out after ",
        absl::FormatDuration(pending->second.timeout), ": ",
        run.collecting.size(), " of min_nodes=", run.record.min_nodes(),
        " nodes arrived (",
        base::FirstFew(
            run.collecting.begin(), run.collecting.end(), 16,
            [](const auto& node) { return base::Escape(node.first); }),
        ")"));
    done = std::move(pending->second.done);
    run.collecting.erase(pending);
    if (static_cast<int>(run.collecting.size()) < run.record.min_nodes() &&
        run.last_call != 0) {
      timer_.Cancel(run.last_call);
      run.last_call = 0;
    }
  }
  done(status);
}

void Rendezvous::CancelJoin(JoinId id) {
  absl::MutexLock lock(&mu_);
  for (auto& [run_id, run] : runs_) {
    for (auto it = run.collecting.begin(); it != run.collecting.end(); ++it) {
      if (it->second.id != id) continue;
      timer_.Cancel(it->second.timer);
      run.collecting.erase(it);
      if (static_cast<int>(run.collecting.size()) < run.record.min_nodes() &&
          run.last_call != 0) {
        timer_.Cancel(run.last_call);
        run.last_call = 0;
      }
      return;
    }
  }
}

absl::StatusOr<v1::RunState> Rendezvous::GetRunState(
    const std::string& run_id) {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(run_id);
  if (it == runs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no run '", base::Escape(run_id), "'"));
  }
  const Run& run = it->second;
  v1::RunState state = run.record;
  if (state.phase() == v1::RunState::CLOSED) return state;
  if (!run.has_completed) {
    state.set_round(0);
    state.set_phase(v1::RunState::COLLECTING);
    state.clear_participants();
    for (const auto& [node_id, pending] : run.collecting) {
      *state.add_participants() = pending.node;
    }
  } else {
    state.set_num_waiting(static_cast<int32_t>(run.collecting.size()));
  }
  return state;
}

absl::StatusOr<v1::ListParticipantsResponse> Rendezvous::ListParticipants(
    const v1::ListParticipantsRequest& req) {
  if (req.page_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size must be >= 0, got ", req.page_size()));
  }
  const int page_size =
      req.page_size() == 0
          ? kDefaultParticipantsPage
          : std::min<int>(req.page_size(), kMaxParticipantsPage);
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(req.run_id());
  if (it == runs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no run '", base::Escape(req.run_id()), "'"));
  }
  const Run& run = it->second;
  if (!run.has_completed) {
    return absl::FailedPreconditionError(
        absl::StrCat("run '", base::Escape(req.run_id()),
                     "' has no completed round yet: its first round is "
                     "still collecting nodes"));
  }
  const int64_t round = run.record.round();
  const int num_nodes = run.record.participants_size();
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
  v1::ListParticipantsResponse resp;
  resp.set_round(round);
  resp.set_num_nodes(num_nodes);
  const int end = std::min(num_nodes, offset + page_size);
  for (int i = offset; i < end; ++i) {
    *resp.add_participants() = run.record.participants(i);
  }
  if (end < num_nodes) resp.set_next_page_token(absl::StrCat(round, ":", end));
  return resp;
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
    if (absl::Status s =
            store_->Set(RunKey(run_id), record.SerializeAsString()).status();
        !s.ok()) {
      return s;
    }
    run.record = record;
    if (run.last_call != 0) timer_.Cancel(run.last_call);
    run.last_call = 0;
    const absl::Status closed = absl::FailedPreconditionError(
        absl::StrCat("run '", base::Escape(run_id), "' was closed"));
    for (auto& [node_id, pending] : run.collecting) {
      timer_.Cancel(pending.timer);
      deferred.push_back(
          [done = std::move(pending.done), closed] { done(closed); });
    }
    run.collecting.clear();
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
      for (auto& [node_id, pending] : run.collecting) {
        timer_.Cancel(pending.timer);
        deferred.push_back(
            [done = std::move(pending.done), status] { done(status); });
      }
      run.collecting.clear();
    }
  }
  for (auto& fn : deferred) fn();
}

RendezvousStats Rendezvous::stats() {
  absl::MutexLock lock(&mu_);
  RendezvousStats stats;
  stats.rounds_completed = rounds_completed_;
  stats.runs = runs_.size();
  for (const auto& [run_id, run] : runs_) {
    stats.waiting_nodes += run.collecting.size();
  }
  return stats;
}

}  // namespace cohort::server

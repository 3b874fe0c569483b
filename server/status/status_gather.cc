#include "server/status/status_gather.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/text.h"
#include "proto/auth/roles.h"
#include "proto/flight/flight_keys.h"

namespace cohort::server {
namespace {

// Members read for a diagnosis's liveness: every node of a big job.
constexpr size_t kDiagnosisMembers = 1 << 20;
// The digits of a round in a dump's key (flight_keys.h).
constexpr size_t kRoundDigits = 12;

bool Visible(const Grant& viewer, absl::string_view what,
             absl::string_view name) {
  return CheckAccess(viewer, what, name, Access::kRead).ok();
}

}  // namespace

std::string ViewerName(const Grant& viewer) {
  if (viewer.source == "auth off") return "auth off";
  return absl::StrCat(auth::RoleName(viewer.role), " token for prefix '",
                      viewer.prefix, "'");
}

absl::StatusOr<StatusView> StatusReader::Read(const StatusSources& sources,
                                              const StatusQuery& query,
                                              absl::Time now) {
  StatusView view;
  view.now = now;
  view.revision = sources.store->revision();
  if (query.viewer.prefix == "*" && query.run.empty()) {
    view.keys = sources.store->stats().keys;
  }
  view.coordinating = sources.rendezvous != nullptr;
  view.viewer = ViewerName(query.viewer);
  auto wanted = [&](absl::string_view what, const std::string& name) {
    return query.run.empty() ? Visible(query.viewer, what, name)
                             : name == query.run;
  };
  if (sources.rendezvous != nullptr) {
    for (const std::string& run : sources.rendezvous->RunIds()) {
      if (!wanted("run", run)) continue;
      if (view.runs.size() == bounds_.runs) {
        ++view.runs_unlisted;
        continue;
      }
      view.runs.push_back(ReadRun(sources, run, now));
    }
  }
  if (sources.membership != nullptr) {
    for (const std::string& group : sources.membership->GroupNames()) {
      if (!wanted("group", group)) continue;
      if (view.groups.size() == bounds_.groups) {
        ++view.groups_unlisted;
        continue;
      }
      absl::StatusOr<GroupSnapshot> snapshot =
          sources.membership->Snapshot(group, bounds_.listed);
      // A group gone since GroupNames is left out.
      if (snapshot.ok()) view.groups.push_back(std::move(*snapshot));
    }
  }
  if (!query.run.empty() && view.runs.empty() && view.groups.empty()) {
    return absl::NotFoundError(
        view.coordinating
            ? absl::StrCat("no run or group '", base::Escape(query.run), "'")
            : absl::StrCat("this cohortd replica does not lead: runs and "
                           "groups are on the leader; ask it for '",
                           base::Escape(query.run), "'"));
  }
  return view;
}

RunView StatusReader::ReadRun(const StatusSources& sources,
                              const std::string& run, absl::Time now) {
  RunView out;
  out.run = run;
  v1::GetRunStateRequest req;
  req.set_run_id(run);
  req.set_omit_participants(true);
  absl::StatusOr<v1::RunState> state = sources.rendezvous->GetRunState(req);
  if (state.ok()) {
    out.state = std::move(*state);
    const int n = out.state.num_participants();
    if (n > 0 && static_cast<size_t>(n) <= bounds_.listed) {
      req.set_omit_participants(false);
      if (absl::StatusOr<v1::RunState> full =
              sources.rendezvous->GetRunState(req);
          full.ok()) {
        out.nodes.assign(full->participants().begin(),
                         full->participants().end());
      }
    } else if (n > 0 && out.state.phase() != v1::RunState::COLLECTING) {
      v1::GetParticipantsRequest first;
      first.set_run_id(run);
      v1::NodeRankRange* range = first.add_ranges();
      range->set_start_node_rank(0);
      range->set_end_node_rank(static_cast<int32_t>(bounds_.listed));
      if (absl::StatusOr<v1::GetParticipantsResponse> some =
              sources.rendezvous->GetParticipants(first);
          some.ok()) {
        out.nodes.assign(some->participants().begin(),
                         some->participants().end());
      }
    }
  }
  RunFacts facts = Facts(sources, run, now);
  out.keys = facts.keys;
  out.diagnosis = std::move(facts.diagnosis);
  return out;
}

StatusReader::RunFacts StatusReader::Facts(const StatusSources& sources,
                                           const std::string& run,
                                           absl::Time now) {
  {
    absl::MutexLock lock(&mu_);
    auto it = facts_.find(run);
    if (it != facts_.end() && now - it->second.at < bounds_.refresh) {
      return it->second;
    }
  }
  // Scanned with no lock held: two viewers at once may both scan.
  RunFacts facts = Scan(sources, run, now);
  absl::MutexLock lock(&mu_);
  if (facts_.size() >= 2 * bounds_.runs) {
    // Forget runs not asked about lately (gone, or another viewer's).
    absl::erase_if(facts_, [&](const auto& entry) {
      return now - entry.second.at >= bounds_.refresh;
    });
  }
  facts_[run] = facts;
  return facts;
}

StatusReader::RunFacts StatusReader::Scan(const StatusSources& sources,
                                          const std::string& run,
                                          absl::Time now) {
  RunFacts facts;
  facts.at = now;
  int64_t keys = 0;
  bool counted = true;
  for (absl::string_view space : kRunNamespaces) {
    absl::StatusOr<store::NumKeysResult> n =
        sources.store->NumKeys(absl::StrCat(space, run, "/"));
    counted = counted && n.ok();
    if (n.ok()) keys += n->num_keys;
  }
  if (counted) facts.keys = keys;
  std::vector<std::string> errors;
  std::vector<std::pair<std::string, std::string>> dumps =
      NewestDumps(*sources.store, run, errors);
  if (dumps.empty() && errors.empty()) return facts;
  std::optional<GroupSnapshot> group;
  if (sources.membership != nullptr) {
    absl::StatusOr<GroupSnapshot> snapshot =
        sources.membership->Snapshot(run, kDiagnosisMembers);
    if (snapshot.ok()) group = std::move(*snapshot);
  }
  RunDiagnosis diagnosis =
      DiagnoseDumps(dumps, group.has_value() ? &*group : nullptr, now);
  diagnosis.errors.insert(diagnosis.errors.begin(), errors.begin(),
                          errors.end());
  facts.diagnosis = std::move(diagnosis);
  return facts;
}

std::vector<std::pair<std::string, std::string>> StatusReader::NewestDumps(
    store::KvStore& store, const std::string& run,
    std::vector<std::string>& errors) {
  const std::string prefix = flight::FlightDumpsPrefix(run);
  std::vector<std::string> keys;
  std::string token;
  do {
    absl::StatusOr<store::ListResult> page = store.ListKeys(prefix, 0, token);
    if (!page.ok()) {
      errors.push_back(absl::StrCat("listing the flight dumps failed: ",
                                    page.status().message()));
      return {};
    }
    for (std::string& key : page->keys) keys.push_back(std::move(key));
    token = page->next_page_token;
    if (!token.empty() && keys.size() >= bounds_.dump_keys) {
      errors.push_back(absl::StrCat(
          "more than ", bounds_.dump_keys,
          " flight dump keys: the newest round may be past them; run "
          "`cohortctl diagnose ",
          base::Escape(run, 64), "`"));
      break;
    }
  } while (!token.empty());
  // Rounds are zero-padded, so the greatest is the newest.
  std::string newest;
  for (const std::string& key : keys) {
    newest = std::max(newest, key.substr(prefix.size(), kRoundDigits));
  }
  std::vector<std::pair<std::string, std::string>> out;
  size_t bytes = 0;
  for (const std::string& key : keys) {
    if (key.compare(prefix.size(), kRoundDigits, newest) != 0) continue;
    absl::StatusOr<std::optional<std::string>> value = store.TryGet(key);
    if (!value.ok() || !value->has_value()) continue;  // Gone since listed.
    bytes += (*value)->size();
    if (bytes > bounds_.dump_bytes) {
      errors.push_back(absl::StrCat(
          "the flight dumps of round ", newest, " pass ", bounds_.dump_bytes,
          " bytes; diagnosed from the first ", out.size(),
          "; run `cohortctl diagnose ", base::Escape(run, 64), "`"));
      break;
    }
    out.emplace_back(key, std::move(**value));
  }
  return out;
}

}  // namespace cohort::server

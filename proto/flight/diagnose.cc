#include "proto/flight/diagnose.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace cohort::flight {
namespace {

using cohort::v1::FlightDump;
using cohort::v1::FlightOp;

bool IsPointToPoint(const FlightOp& op) {
  return op.op() == "Send" || op.op() == "Recv";
}

// One rank's collectives, by seq, and where it stands.
struct RankView {
  int rank = 0;
  const FlightDump* dump = nullptr;
  std::map<uint64_t, const FlightOp*> ops;
  // The first collective not done (running, queued or failed), or null.
  const FlightOp* current = nullptr;
  // The highest seq done, or -1.
  int64_t last_done = -1;
};

RankView ViewOf(const FlightDump& dump) {
  RankView v;
  v.rank = dump.rank();
  v.dump = &dump;
  for (const FlightOp& op : dump.ops()) {
    if (IsPointToPoint(op)) continue;
    v.ops[op.seq()] = &op;
  }
  for (const auto& [seq, op] : v.ops) {
    if (op->state() == "done") {
      v.last_done = std::max<int64_t>(v.last_done, static_cast<int64_t>(seq));
    } else if (v.current == nullptr) {
      v.current = op;
    }
  }
  return v;
}

// "AllReduce #12".
std::string Label(const FlightOp& op) {
  return absl::StrCat(op.op(), " #", op.seq());
}

// "SUM, f32, 1024 elements" / "root 0, f32, 16 elements".
std::string Arguments(const FlightOp& op) {
  std::vector<std::string> parts;
  if (!op.reduce().empty()) parts.push_back(op.reduce());
  if (op.root() >= 0) parts.push_back(absl::StrCat("root ", op.root()));
  parts.push_back(op.dtype());
  parts.push_back(
      absl::StrCat(op.count(), op.count() == 1 ? " element" : " elements"));
  return absl::StrJoin(parts, ", ");
}

std::string Clock(int64_t us) {
  return absl::FormatTime("%H:%M:%S", absl::FromUnixMicros(us),
                          absl::UTCTimeZone());
}

std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%.0f s", absl::ToDoubleSeconds(d));
}

std::string Ranks(const std::vector<int>& ranks) {
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ",
                      RankRanges(ranks));
}

// What membership says of `rank`, for a sentence: " (its last heartbeat
// was 2 s ago)", " (dead in membership; ...)" or "".
std::string LivenessNote(const std::map<int, Liveness>& liveness, int rank) {
  auto it = liveness.find(rank);
  if (it == liveness.end()) return "";
  const Liveness& l = it->second;
  if (!l.alive && !l.heartbeat_known) return " (dead in membership)";
  if (!l.alive) {
    return absl::StrCat(" (dead in membership; its last heartbeat was ",
                        Seconds(l.since_heartbeat), " ago)");
  }
  if (!l.heartbeat_known) return "";
  return absl::StrCat(" (its last heartbeat was ", Seconds(l.since_heartbeat),
                      " ago)");
}

// The earliest seq that ranks disagree on: different ops, or the same op
// with different arguments.
void FindMismatch(const std::vector<RankView>& views, const std::string& group,
                  std::vector<Finding>& findings) {
  std::map<uint64_t, std::map<std::string, std::vector<int>>> by_seq;
  std::map<uint64_t, std::map<std::string, std::string>> ops_of;
  for (const RankView& v : views) {
    for (const auto& [seq, op] : v.ops) {
      const std::string key = absl::StrCat(op->op(), " (", Arguments(*op), ")");
      by_seq[seq][key].push_back(v.rank);
      ops_of[seq][key] = op->op();
    }
  }
  for (const auto& [seq, variants] : by_seq) {
    if (variants.size() < 2) continue;
    std::vector<std::string> parts;
    std::vector<std::string> names;
    // The culprits: every rank outside the largest group of agreeing ranks.
    const std::vector<int>* majority = nullptr;
    for (const auto& [key, ranks] : variants) {
      parts.push_back(absl::StrCat(Ranks(ranks), " issued ", key));
      names.push_back(ops_of[seq][key]);
      if (majority == nullptr || ranks.size() > majority->size()) {
        majority = &ranks;
      }
    }
    std::vector<int> minority;
    for (const auto& [key, ranks] : variants) {
      if (&ranks != majority) {
        minority.insert(minority.end(), ranks.begin(), ranks.end());
      }
    }
    const bool same_op =
        std::all_of(names.begin(), names.end(),
                    [&](const std::string& n) { return n == names.front(); });
    Finding f;
    f.kind =
        same_op ? Finding::Kind::kArgumentMismatch : Finding::Kind::kMismatch;
    f.seq = seq;
    std::sort(minority.begin(), minority.end());
    f.ranks = minority;
    f.sentence =
        absl::StrCat(same_op ? "arguments differ" : "ops differ", " at #", seq,
                     " of group ", group, ": ", absl::StrJoin(parts, "; "));
    findings.push_back(std::move(f));
    return;  // The first disagreement explains the rest.
  }
}

// Ranks inside an op that other ranks have not entered, or (when no op is
// running any more) ranks whose op failed, a timeout typically, while
// others never entered it.
void FindHang(const std::vector<RankView>& views, const std::string& group,
              const std::vector<int>& silent,
              const std::map<int, Liveness>& liveness,
              std::vector<Finding>& findings) {
  std::string state = "running";
  const FlightOp* stuck = nullptr;
  for (const std::string s : {"running", "failed"}) {
    for (const RankView& v : views) {
      if (v.current == nullptr || v.current->state() != s) continue;
      if (stuck == nullptr || v.current->seq() > stuck->seq()) {
        stuck = v.current;
      }
    }
    state = s;
    if (stuck != nullptr) break;
  }
  if (stuck == nullptr) return;
  const uint64_t seq = stuck->seq();
  std::vector<int> inside;
  int64_t since = 0;
  std::vector<std::string> behind;
  std::vector<int> culprits;
  for (const RankView& v : views) {
    const FlightOp* c = v.current;
    if (c != nullptr && c->seq() == seq && c->state() == state) {
      inside.push_back(v.rank);
      if (since == 0 || c->started_us() < since) since = c->started_us();
      continue;
    }
    // Done with it already (a root can finish a Broadcast first).
    if (v.last_done >= static_cast<int64_t>(seq)) continue;
    culprits.push_back(v.rank);
    const std::string note = LivenessNote(liveness, v.rank);
    if (c == nullptr || c->seq() > seq) {
      behind.push_back(absl::StrCat("rank ", v.rank, " last completed #",
                                    v.last_done, " and has not entered #", seq,
                                    note));
    } else if (c->seq() == seq) {
      behind.push_back(absl::StrCat("rank ", v.rank, " has queued #", seq,
                                    " but not started it", note));
    } else {
      behind.push_back(absl::StrCat("rank ", v.rank, " is still in ", Label(*c),
                                    " (", c->state(), ")", note));
    }
  }
  for (int r : silent) {
    culprits.push_back(r);
    behind.push_back(absl::StrCat("rank ", r, " sent no flight records",
                                  LivenessNote(liveness, r)));
  }
  // Every rank failed in it: a failure (FindFailures), not a wait.
  if (state == "failed" && behind.empty()) return;
  Finding f;
  f.kind = Finding::Kind::kHang;
  f.seq = seq;
  std::sort(culprits.begin(), culprits.end());
  f.ranks = culprits;
  if (state == "running") {
    f.sentence =
        absl::StrCat(Ranks(inside), inside.size() == 1 ? " is" : " are", " in ",
                     Label(*stuck), " of group ", group, " (",
                     Arguments(*stuck), ") since ", Clock(since));
  } else {
    f.sentence = absl::StrCat(Ranks(inside), " failed in ", Label(*stuck),
                              " of group ", group, " (", Arguments(*stuck),
                              "), entered at ", Clock(since));
  }
  if (behind.empty()) {
    absl::StrAppend(&f.sentence,
                    "; every rank entered it and none has finished it");
  } else {
    absl::StrAppend(&f.sentence, "; ", absl::StrJoin(behind, "; "));
  }
  findings.push_back(std::move(f));
}

// Each rank's first failed op (the group is broken after it), one
// finding per op: a thousand ranks failing in one collective make one
// line, with the lowest rank's error.
void FindFailures(const std::vector<RankView>& views,
                  std::vector<Finding>& out) {
  std::map<std::string, Finding> by_op;  // By Label.
  std::vector<std::string> order;
  for (const RankView& v : views) {
    for (const FlightOp& op : v.dump->ops()) {
      if (op.state() != "failed") continue;
      const std::string label = Label(op);
      auto [it, added] = by_op.try_emplace(label);
      Finding& f = it->second;
      if (added) {
        order.push_back(label);
        f.kind = Finding::Kind::kFailed;
        f.seq = op.seq();
        f.sentence = op.error();  // The first (lowest) rank's error.
      }
      f.ranks.push_back(v.rank);
      break;
    }
  }
  for (const std::string& label : order) {
    Finding& f = by_op[label];
    const std::string error = std::move(f.sentence);
    f.sentence = f.ranks.size() == 1
                     ? absl::StrCat("rank ", f.ranks[0], "'s ", label,
                                    " failed: ", error)
                     : absl::StrCat(label, " failed on ", Ranks(f.ranks),
                                    "; rank ", f.ranks[0], "'s error: ", error);
    out.push_back(std::move(f));
  }
}

void FindStragglers(const std::vector<RankView>& views,
                    const DiagnoseOptions& options, const std::string& group,
                    std::vector<Finding>& out) {
  if (views.size() < 2) return;
  // Seqs done on every rank, newest first.
  std::vector<uint64_t> common;
  for (auto it = views[0].ops.rbegin(); it != views[0].ops.rend(); ++it) {
    const uint64_t seq = it->first;
    const bool everywhere =
        std::all_of(views.begin(), views.end(), [&](const RankView& v) {
          auto op = v.ops.find(seq);
          return op != v.ops.end() && op->second->state() == "done";
        });
    if (everywhere) common.push_back(seq);
    if (static_cast<int>(common.size()) == options.straggler_window) break;
  }
  if (common.empty()) return;
  std::map<int, int> last_count;
  std::map<int, double> late_us;
  const double threshold_us =
      absl::ToDoubleMicroseconds(options.straggler_threshold);
  for (uint64_t seq : common) {
    int64_t first = 0, latest = 0;
    int last_rank = -1;
    for (const RankView& v : views) {
      const int64_t s = v.ops.at(seq)->started_us();
      if (first == 0 || s < first) first = s;
      if (last_rank < 0 || s > latest) {
        latest = s;
        last_rank = v.rank;
      }
    }
    for (const RankView& v : views) {
      late_us[v.rank] += v.ops.at(seq)->started_us() - first;
    }
    if (latest - first >= threshold_us) ++last_count[last_rank];
  }
  int worst = -1;
  for (const auto& [rank, total] : late_us) {
    if (worst < 0 || total > late_us[worst]) worst = rank;
  }
  const double mean_us = late_us[worst] / common.size();
  if (worst < 0 || mean_us < threshold_us) return;
  Finding f;
  f.kind = Finding::Kind::kStraggler;
  f.ranks = {worst};
  f.sentence = absl::StrFormat(
      "rank %d is the straggler of group %s: it entered last in %d of the "
      "last %d collectives, on average %.1f ms after the first rank",
      worst, group, last_count[worst], static_cast<int>(common.size()),
      mean_us / 1000);
  out.push_back(std::move(f));
}

}  // namespace

std::string RankRanges(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<std::string> runs;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    runs.push_back(j == i ? absl::StrCat(ranks[i])
                          : absl::StrCat(ranks[i], "-", ranks[j]));
    i = j + 1;
  }
  return absl::StrJoin(runs, ",");
}

std::string Diagnosis::Text() const {
  if (findings.empty()) {
    return "no problem found: the ranks' records agree and no op is stuck\n";
  }
  std::string text;
  for (const Finding& f : findings) absl::StrAppend(&text, f.sentence, "\n");
  return text;
}

Diagnosis Diagnose(const std::vector<FlightDump>& dumps,
                   const std::map<int, Liveness>& liveness,
                   const DiagnoseOptions& options) {
  int world = options.world_size;
  std::string group = "0";
  for (const FlightDump& d : dumps) {
    if (options.world_size == 0) world = std::max(world, d.world_size());
    if (!d.group().empty()) group = d.group();
  }
  std::vector<RankView> views;
  std::vector<bool> seen(std::max(world, 0), false);
  for (const FlightDump& d : dumps) {
    if (d.rank() < 0 || d.rank() >= world || seen[d.rank()]) continue;
    seen[d.rank()] = true;
    views.push_back(ViewOf(d));
  }
  std::sort(
      views.begin(), views.end(),
      [](const RankView& a, const RankView& b) { return a.rank < b.rank; });
  std::vector<int> silent;
  for (int r = 0; r < world; ++r) {
    if (!seen[r]) silent.push_back(r);
  }

  Diagnosis diagnosis;
  FindMismatch(views, group, diagnosis.findings);
  FindHang(views, group, silent, liveness, diagnosis.findings);
  FindFailures(views, diagnosis.findings);
  for (const auto& [rank, state] : liveness) {
    if (state.alive) continue;
    Finding f;
    f.kind = Finding::Kind::kDead;
    f.ranks = {rank};
    f.sentence = absl::StrCat("rank ", rank, " is dead in membership");
    if (state.heartbeat_known) {
      absl::StrAppend(&f.sentence, ": its last heartbeat was ",
                      Seconds(state.since_heartbeat), " ago");
    }
    diagnosis.findings.push_back(std::move(f));
  }
  const bool hang = std::any_of(
      diagnosis.findings.begin(), diagnosis.findings.end(),
      [](const Finding& f) { return f.kind == Finding::Kind::kHang; });
  if (!hang && !silent.empty()) {
    Finding f;
    f.kind = Finding::Kind::kDead;
    f.ranks = silent;
    f.sentence = absl::StrCat(Ranks(silent), " sent no flight records");
    diagnosis.findings.push_back(std::move(f));
  }
  if (diagnosis.findings.empty()) {
    FindStragglers(views, options, group, diagnosis.findings);
  }
  return diagnosis;
}

}  // namespace cohort::flight

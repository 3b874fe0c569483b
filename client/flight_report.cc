#include "client/flight_report.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/flight_catalog.h"
#include "proto/flight/flight_keys.h"

namespace cohort {
namespace {

struct Collected {
  int64_t request = 0;
  FlightCatalog::Answers answers;
};

absl::StatusOr<Collected> Collect(Store& store, const std::string& run,
                                  const FlightReportOptions& options) {
  FlightCatalog catalog(&store, run);
  Collected c;
  if (options.request) {
    absl::StatusOr<int64_t> request = catalog.Request();
    if (!request.ok()) return request.status();
    c.request = *request;
    absl::StatusOr<FlightCatalog::Answers> answers =
        catalog.WaitForAnswers(c.request, options.answer_timeout);
    if (!answers.ok()) return answers.status();
    c.answers = *std::move(answers);
  } else {
    absl::StatusOr<FlightCatalog::Listing> listing = catalog.List();
    if (!listing.ok()) return listing.status();
    c.answers.listing = *std::move(listing);
  }
  if (c.answers.listing.dumps.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "run ", run, " has no flight dumps under ", flight::FlightPrefix(run),
        options.request
            ? absl::StrCat(": no rank answered within ",
                           absl::FormatDuration(options.answer_timeout),
                           " (are its workers running under cohortrun, "
                           "with process groups created?)")
            : ""));
  }
  return c;
}

std::string Unanswered(const Collected& c) {
  std::string out;
  for (const std::string& m : c.answers.missing) {
    absl::StrAppend(&out, "no answer to request ", c.request, " from ", m,
                    "\n");
  }
  for (const std::string& u : c.answers.listing.unreadable) {
    absl::StrAppend(&out, "unreadable: ", u, "\n");
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> DumpReport(Store& store, const std::string& run,
                                       const FlightReportOptions& options) {
  absl::StatusOr<Collected> c = Collect(store, run, options);
  if (!c.ok()) return c.status();
  // By round and group: the ranks whose dump answers this request.
  std::map<std::pair<int64_t, std::string>, std::vector<int>> answered;
  for (const auto& d : c->answers.listing.dumps) {
    if (d.request() >= c->request) {
      answered[{d.round(), d.group()}].push_back(d.rank());
    }
  }
  std::string out;
  for (const auto& [where, ranks] : answered) {
    absl::StrAppend(&out, "round ", where.first, " group ", where.second, ": ",
                    ranks.size() == 1 ? "rank " : "ranks ",
                    flight::RankRanges(ranks), " dumped (request ", c->request,
                    ")\n");
  }
  absl::StrAppend(&out, Unanswered(*c));
  return out;
}

std::map<std::string, flight::Liveness> LivenessByNode(
    const std::vector<Member>& members, const std::vector<std::string>& nodes) {
  std::map<std::string, flight::Liveness> by_node;
  // No member at all: the job is over (or never ran under cohortrun), and
  // membership says nothing of its nodes.
  if (members.empty()) return by_node;
  for (const Member& m : members) {
    by_node[m.name] = flight::Liveness{true, m.heartbeat_age, true};
  }
  for (const std::string& node : nodes) {
    if (!node.empty() && !by_node.count(node)) {
      by_node[node] = flight::Liveness{false, absl::ZeroDuration(), false};
    }
  }
  return by_node;
}

absl::StatusOr<std::string> DiagnoseReport(Store& store,
                                           MembershipClient* members,
                                           const std::string& run,
                                           const FlightReportOptions& options) {
  absl::StatusOr<Collected> c = Collect(store, run, options);
  if (!c.ok()) return c.status();
  std::map<std::string, flight::Liveness> by_node;
  if (members != nullptr) {
    absl::StatusOr<std::vector<Member>> listed = members->ListMembers(run);
    if (!listed.ok()) return listed.status();
    std::set<std::string> nodes;
    for (const auto& d : c->answers.listing.dumps) nodes.insert(d.node());
    by_node = LivenessByNode(*listed, {nodes.begin(), nodes.end()});
  }
  std::string out;
  for (const flight::GroupDiagnosis& g :
       flight::DiagnoseRun(c->answers.listing.dumps, by_node, options.diagnose,
                           options.round)) {
    absl::StrAppend(&out, "run ", run, " round ", g.round, " group ", g.group,
                    " (", g.ranks_dumped,
                    g.ranks_dumped == 1 ? " rank" : " ranks", " dumped):\n");
    absl::StrAppend(&out, g.diagnosis.Text());
    if (!out.empty() && out.back() != '\n') out += '\n';
  }
  absl::StrAppend(&out, Unanswered(*c));
  return out;
}

}  // namespace cohort

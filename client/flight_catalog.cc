#include "client/flight_catalog.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "proto/flight/flight_keys.h"

namespace cohort {

FlightCatalog::FlightCatalog(Store* store, std::string run)
    : store_(store), run_(std::move(run)) {}

absl::StatusOr<int64_t> FlightCatalog::Request() {
  return store_->Add(flight::FlightRequestKey(run_), 1);
}

absl::StatusOr<int64_t> FlightCatalog::CurrentRequest() {
  // Adding 0 reads the counter without blocking on a key not yet there.
  return store_->Add(flight::FlightRequestKey(run_), 0);
}

absl::StatusOr<std::unique_ptr<WatchHandle>> FlightCatalog::WatchRequests(
    std::function<void(int64_t)> on_request) {
  const std::string key = flight::FlightRequestKey(run_);
  return store_->Watch(
      key, 0, [key, on_request = std::move(on_request)](const WatchEvent& e) {
        int64_t number = 0;
        if (e.key == key && e.type == WatchEvent::Type::kPut &&
            absl::SimpleAtoi(e.value, &number)) {
          on_request(number);
        }
      });
}

absl::Status FlightCatalog::Publish(const v1::FlightDump& dump) {
  if (dump.run() != run_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flight dump of run '", dump.run(), "' published to run '", run_, "'"));
  }
  return store_->Set(
      flight::FlightDumpKey(run_, dump.round(), dump.group(), dump.rank()),
      flight::EncodeFlightDump(dump));
}

absl::StatusOr<FlightCatalog::Listing> FlightCatalog::List() {
  absl::StatusOr<KeyList> keys =
      store_->ListKeys(flight::FlightDumpsPrefix(run_));
  if (!keys.ok()) return keys.status();
  Listing listing;
  if (keys->keys.empty()) return listing;
  absl::StatusOr<std::vector<std::string>> values =
      store_->MultiGet(keys->keys, absl::Seconds(10));
  if (!values.ok()) return values.status();
  for (size_t i = 0; i < keys->keys.size(); ++i) {
    absl::StatusOr<v1::FlightDump> dump =
        flight::DecodeFlightDump(keys->keys[i], (*values)[i]);
    if (dump.ok()) {
      listing.dumps.push_back(*std::move(dump));
    } else {
      listing.unreadable.push_back(std::string(dump.status().message()));
    }
  }
  return listing;
}

namespace {

// By group, the ranks of the newest round that have not answered
// `request`.
std::vector<std::string> Missing(const std::vector<v1::FlightDump>& dumps,
                                 int64_t request) {
  int64_t round = 0;
  for (const auto& d : dumps) round = std::max(round, d.round());
  std::map<std::string, std::pair<int, std::set<int>>> groups;
  for (const auto& d : dumps) {
    if (d.round() != round) continue;
    auto& [world, answered] = groups[d.group()];
    world = std::max(world, d.world_size());
    if (d.request() >= request) answered.insert(d.rank());
  }
  std::vector<std::string> missing;
  for (const auto& [group, entry] : groups) {
    std::vector<int> ranks;
    for (int r = 0; r < entry.first; ++r) {
      if (!entry.second.count(r)) ranks.push_back(r);
    }
    if (!ranks.empty()) {
      missing.push_back(absl::StrCat("group ", group, ": rank",
                                     ranks.size() > 1 ? "s " : " ",
                                     absl::StrJoin(ranks, ",")));
    }
  }
  return missing;
}

}  // namespace

absl::StatusOr<FlightCatalog::Answers> FlightCatalog::WaitForAnswers(
    int64_t request, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<Listing> listing = List();
    if (!listing.ok()) return listing.status();
    Answers answers;
    answers.missing = Missing(listing->dumps, request);
    const bool none_yet = listing->dumps.empty();
    answers.listing = *std::move(listing);
    if ((!none_yet && answers.missing.empty()) || absl::Now() >= deadline) {
      if (none_yet) answers.missing.push_back("no rank has dumped");
      return answers;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

}  // namespace cohort

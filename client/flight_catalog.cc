#include "client/flight_catalog.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
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
  const std::vector<std::string> keys = {
      flight::FlightDumpKey(run_, dump.round(), dump.group(), dump.rank()),
      flight::FlightAnswerKey(run_, dump.round(), dump.group(), dump.rank())};
  const std::vector<std::string> values = {flight::EncodeFlightDump(dump),
                                           flight::EncodeFlightAnswer(dump)};
  return store_->MultiSet(keys, values);
}

namespace {

// `prefix`, narrowed to one round unless `round` is -1.
std::string RoundPrefix(const std::string& prefix, int64_t round) {
  return round < 0 ? prefix : absl::StrFormat("%s%012d/", prefix, round);
}

// The values of every key under `prefix`, `batch` keys per MultiGet.
absl::StatusOr<std::pair<std::vector<std::string>, std::vector<std::string>>>
ReadAll(Store& store, const std::string& prefix, size_t batch) {
  absl::StatusOr<KeyList> keys = store.ListKeys(prefix);
  if (!keys.ok()) return keys.status();
  std::vector<std::string> values;
  values.reserve(keys->keys.size());
  for (size_t first = 0; first < keys->keys.size(); first += batch) {
    const size_t n = std::min(batch, keys->keys.size() - first);
    absl::StatusOr<std::vector<std::string>> got = store.MultiGet(
        absl::MakeConstSpan(keys->keys).subspan(first, n), absl::Seconds(10));
    if (!got.ok()) return got.status();
    for (std::string& v : *got) values.push_back(std::move(v));
  }
  return std::make_pair(std::move(keys->keys), std::move(values));
}

}  // namespace

absl::StatusOr<FlightCatalog::Listing> FlightCatalog::List(int64_t round) {
  // 16 dumps of at most 256 KiB: 4 MiB a call.
  auto read =
      ReadAll(*store_, RoundPrefix(flight::FlightDumpsPrefix(run_), round), 16);
  if (!read.ok()) return read.status();
  const auto& [keys, values] = *read;
  Listing listing;
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<v1::FlightDump> dump =
        flight::DecodeFlightDump(keys[i], values[i]);
    if (dump.ok()) {
      listing.dumps.push_back(*std::move(dump));
    } else {
      listing.unreadable.push_back(std::string(dump.status().message()));
    }
  }
  return listing;
}

absl::StatusOr<FlightCatalog::AnswerList> FlightCatalog::ListAnswers(
    int64_t round) {
  auto read = ReadAll(
      *store_, RoundPrefix(flight::FlightAnswersPrefix(run_), round), 4096);
  if (!read.ok()) return read.status();
  const auto& [keys, values] = *read;
  AnswerList list;
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<flight::FlightAnswer> a =
        flight::DecodeFlightAnswer(run_, keys[i], values[i]);
    if (a.ok()) {
      list.answers.push_back(*std::move(a));
    } else {
      list.unreadable.push_back(std::string(a.status().message()));
    }
  }
  return list;
}

namespace {

// The newest round among `answers`, and by group there the ranks that have
// not answered `request`.
std::pair<int64_t, std::vector<std::string>> Missing(
    const std::vector<flight::FlightAnswer>& answers, int64_t request) {
  int64_t round = 0;
  for (const auto& a : answers) round = std::max(round, a.round);
  std::map<std::string, std::pair<int, std::set<int>>> groups;
  for (const auto& a : answers) {
    if (a.round != round) continue;
    auto& [world, answered] = groups[a.group];
    world = std::max(world, a.world_size);
    if (a.request >= request) answered.insert(a.rank);
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
  return {round, missing};
}

}  // namespace

absl::StatusOr<FlightCatalog::Answers> FlightCatalog::WaitForAnswers(
    int64_t request, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<AnswerList> list = ListAnswers();
    if (!list.ok()) return list.status();
    auto [round, missing] = Missing(list->answers, request);
    const bool none_yet = list->answers.empty();
    if ((!none_yet && missing.empty()) || absl::Now() >= deadline) {
      Answers answers;
      answers.missing = std::move(missing);
      if (none_yet) {
        answers.missing.push_back("no rank has dumped");
        return answers;
      }
      absl::StatusOr<Listing> listing = List(round);
      if (!listing.ok()) return listing.status();
      answers.listing = *std::move(listing);
      for (std::string& u : list->unreadable) {
        answers.listing.unreadable.push_back(std::move(u));
      }
      return answers;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

}  // namespace cohort

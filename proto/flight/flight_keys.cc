#include "proto/flight/flight_keys.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "google/protobuf/util/json_util.h"

namespace cohort::flight {

std::string FlightPrefix(absl::string_view run) {
  return absl::StrCat("runs/", run, "/flight/");
}

std::string FlightRequestKey(absl::string_view run) {
  return absl::StrCat(FlightPrefix(run), "request");
}

std::string FlightDumpsPrefix(absl::string_view run) {
  return absl::StrCat(FlightPrefix(run), "dumps/");
}

std::string FlightDumpKey(absl::string_view run, int64_t round,
                          absl::string_view group, int rank) {
  return absl::StrFormat("%s%012d/%s/%d", FlightDumpsPrefix(run), round, group,
                         rank);
}

std::string FlightAnswersPrefix(absl::string_view run) {
  return absl::StrCat(FlightPrefix(run), "answers/");
}

std::string FlightAnswerKey(absl::string_view run, int64_t round,
                            absl::string_view group, int rank) {
  return absl::StrFormat("%s%012d/%s/%d", FlightAnswersPrefix(run), round,
                         group, rank);
}

std::string EncodeFlightAnswer(const cohort::v1::FlightDump& dump) {
  // "-" stands for no reason, so the value always has three fields.
  return absl::StrCat(dump.request(), " ",
                      dump.reason().empty() ? "-" : dump.reason(), " ",
                      dump.world_size());
}

absl::StatusOr<FlightAnswer> DecodeFlightAnswer(absl::string_view run,
                                                absl::string_view key,
                                                absl::string_view value) {
  FlightAnswer a;
  absl::string_view rest = key;
  const std::vector<absl::string_view> where =
      absl::StrSplit(absl::StripPrefix(rest, FlightAnswersPrefix(run)), '/');
  const std::vector<absl::string_view> fields =
      absl::StrSplit(value, ' ', absl::SkipEmpty());
  if (!absl::StartsWith(key, FlightAnswersPrefix(run)) || where.size() != 3 ||
      !absl::SimpleAtoi(where[0], &a.round) ||
      !absl::SimpleAtoi(where[2], &a.rank) || fields.size() != 3 ||
      !absl::SimpleAtoi(fields[0], &a.request) ||
      !absl::SimpleAtoi(fields[2], &a.world_size)) {
    return absl::DataLossError(absl::StrCat(
        "flight answer at '", key,
        "' is not <request> <reason> <world_size> "
        "under ",
        FlightAnswersPrefix(run), "<round>/<group>/<rank>: '", value, "'"));
  }
  a.group = std::string(where[1]);
  a.reason = fields[1] == "-" ? "" : std::string(fields[1]);
  return a;
}

namespace {

std::string ToJson(const cohort::v1::FlightDump& dump) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  // Every message here is ours and well formed: printing cannot fail.
  (void)google::protobuf::util::MessageToJsonString(dump, &json, options);
  return json;
}

}  // namespace

std::string EncodeFlightDump(cohort::v1::FlightDump dump, size_t max_bytes) {
  std::string json = ToJson(dump);
  while (json.size() > max_bytes && dump.ops_size() > 0) {
    // Drop in proportion to the excess (at least one op), newest kept.
    const size_t excess = json.size() - max_bytes;
    const size_t per_op = std::max<size_t>(1, json.size() / dump.ops_size());
    const int drop =
        std::min<int>(dump.ops_size(), static_cast<int>(excess / per_op) + 1);
    dump.mutable_ops()->DeleteSubrange(0, drop);
    json = ToJson(dump);
  }
  return json;
}

absl::StatusOr<cohort::v1::FlightDump> DecodeFlightDump(
    absl::string_view key, absl::string_view value) {
  cohort::v1::FlightDump dump;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  const auto status = google::protobuf::util::JsonStringToMessage(
      std::string(value), &dump, options);
  if (!status.ok()) {
    return absl::DataLossError(
        absl::StrCat("flight dump at '", key,
                     "' is not a FlightDump in JSON: ", status.ToString()));
  }
  return dump;
}

std::vector<GroupDiagnosis> DiagnoseRun(
    const std::vector<cohort::v1::FlightDump>& dumps,
    const std::map<std::string, Liveness>& by_node,
    const DiagnoseOptions& options, int64_t wanted_round) {
  std::vector<GroupDiagnosis> out;
  if (dumps.empty()) return out;
  int64_t round = dumps.front().round();
  for (const auto& d : dumps) round = std::max(round, d.round());
  std::map<std::string, std::vector<cohort::v1::FlightDump>> groups;
  if (wanted_round >= 0) round = wanted_round;
  for (const auto& d : dumps) {
    if (d.round() == round) groups[d.group()].push_back(d);
  }
  for (auto& [group, members] : groups) {
    std::map<int, Liveness> liveness;
    std::vector<cohort::v1::FlightDump> records;
    GroupDiagnosis g;
    g.round = round;
    g.group = group;
    for (const auto& d : members) {
      auto it = by_node.find(d.node());
      if (it != by_node.end()) liveness[d.rank()] = it->second;
      // A start dump says where the rank runs, not what it did since.
      if (d.reason() == kStartReason) continue;
      records.push_back(d);
    }
    g.ranks_dumped = static_cast<int>(records.size());
    int world = 0;
    for (const auto& d : members) world = std::max(world, d.world_size());
    DiagnoseOptions group_options = options;
    if (group_options.world_size == 0) group_options.world_size = world;
    g.diagnosis = Diagnose(records, liveness, group_options);
    out.push_back(std::move(g));
  }
  return out;
}

}  // namespace cohort::flight

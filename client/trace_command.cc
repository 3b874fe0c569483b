#include "client/trace_command.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/trace_timeline.h"

ABSL_FLAG(std::string, o, "", "trace merge: the merged file to write");

namespace cohort {

namespace {

namespace fs = std::filesystem;

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The rank in a name trace-rank<R>.json, or -1.
int RankOf(const std::string& name) {
  int rank = -1;
  if (!absl::StartsWith(name, "trace-rank") || !absl::EndsWith(name, ".json")) {
    return -1;
  }
  const std::string digits =
      name.substr(10, name.size() - 10 - std::string(".json").size());
  return absl::SimpleAtoi(digits, &rank) ? rank : -1;
}

// The files `inputs` name: each file itself, each folder's
// trace-rank<R>.json by rank.
absl::StatusOr<std::vector<TraceText>> ReadInputs(
    const std::vector<std::string>& inputs) {
  std::vector<TraceText> texts;
  for (const std::string& input : inputs) {
    std::vector<std::string> paths;
    std::error_code error;
    if (fs::is_directory(input, error)) {
      std::vector<std::pair<int, std::string>> ranked;
      for (const fs::directory_entry& entry :
           fs::directory_iterator(input, error)) {
        const int rank = RankOf(entry.path().filename().string());
        if (rank >= 0) ranked.emplace_back(rank, entry.path().string());
      }
      if (error) {
        return absl::FailedPreconditionError(
            absl::StrCat("cannot list ", input, ": ", error.message()));
      }
      if (ranked.empty()) {
        return absl::NotFoundError(
            absl::StrCat(input, " holds no trace-rank<R>.json file"));
      }
      std::sort(ranked.begin(), ranked.end());
      for (auto& [rank, path] : ranked) paths.push_back(std::move(path));
    } else {
      paths.push_back(input);
    }
    for (const std::string& path : paths) {
      absl::StatusOr<std::string> json = ReadFile(path);
      if (!json.ok()) return json.status();
      texts.push_back({path, *std::move(json)});
    }
  }
  return texts;
}

absl::Status WriteAtomically(const std::string& path,
                             const std::string& contents) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << contents;
    if (!out.flush()) {
      return absl::FailedPreconditionError(absl::StrCat("cannot write ", tmp));
    }
  }
  std::error_code error;
  fs::rename(tmp, path, error);
  if (error) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot rename ", tmp, " to ", path, ": ", error.message()));
  }
  return absl::OkStatus();
}

int Misuse(const std::string& problem) {
  std::fprintf(stderr,
               "cohortctl: trace: %s (usage: cohortctl trace merge "
               "DIR|FILE... -o OUT | trace summary DIR|FILE...)\n",
               problem.c_str());
  return 2;
}

int Failed(const absl::Status& status) {
  std::fprintf(stderr, "cohortctl: trace: %s\n", status.ToString().c_str());
  return 1;
}

}  // namespace

int TraceCommand(const std::vector<std::string>& args) {
  if (args.empty()) return Misuse("trace takes merge or summary");
  const std::string& verb = args[0];
  const std::vector<std::string> inputs(args.begin() + 1, args.end());
  if (inputs.empty()) return Misuse(absl::StrCat(verb, " takes DIR|FILE..."));
  if (verb == "merge") {
    const std::string out = absl::GetFlag(FLAGS_o);
    if (out.empty()) return Misuse("merge needs -o OUT");
    absl::StatusOr<std::vector<TraceText>> texts = ReadInputs(inputs);
    if (!texts.ok()) return Failed(texts.status());
    absl::StatusOr<std::string> merged = MergeTraces(*texts);
    if (!merged.ok()) return Failed(merged.status());
    if (absl::Status s = WriteAtomically(out, *merged); !s.ok()) {
      return Failed(s);
    }
    std::fprintf(stderr, "cohortctl: trace: merged %zu file(s) into %s\n",
                 texts->size(), out.c_str());
    return 0;
  }
  if (verb == "summary") {
    absl::StatusOr<std::vector<TraceText>> texts = ReadInputs(inputs);
    if (!texts.ok()) return Failed(texts.status());
    // One file is summarized as it is; several are merged first.
    std::string json = (*texts)[0].json;
    std::string name = (*texts)[0].name;
    if (texts->size() > 1) {
      absl::StatusOr<std::string> merged = MergeTraces(*texts);
      if (!merged.ok()) return Failed(merged.status());
      json = *std::move(merged);
      name = "the merged inputs";
    }
    absl::StatusOr<google::protobuf::Struct> trace = ParseTrace(name, json);
    if (!trace.ok()) return Failed(trace.status());
    absl::StatusOr<TraceSummary> summary = SummarizeTrace(*trace);
    if (!summary.ok()) return Failed(summary.status());
    const std::string text = FormatSummary(*summary);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  return Misuse(absl::StrCat("unknown trace command '", verb,
                             "'; expected merge or summary"));
}

}  // namespace cohort

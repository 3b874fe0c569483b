#include "client/trace_timeline.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"

namespace cohort {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

const Value* Field(const Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? nullptr : &it->second;
}

double Number(const Struct& s, const std::string& key, double otherwise) {
  const Value* v = Field(s, key);
  return v != nullptr && v->kind_case() == Value::kNumberValue
             ? v->number_value()
             : otherwise;
}

std::string String(const Struct& s, const std::string& key) {
  const Value* v = Field(s, key);
  return v != nullptr && v->kind_case() == Value::kStringValue
             ? v->string_value()
             : std::string();
}

const Struct* Object(const Struct& s, const std::string& key) {
  const Value* v = Field(s, key);
  return v != nullptr && v->kind_case() == Value::kStructValue
             ? &v->struct_value()
             : nullptr;
}

const ListValue& Events(const Struct& trace) {
  return Field(trace, "traceEvents")->list_value();
}

std::string Json(const Value& value) {
  std::string out;
  // A Value parsed from JSON always prints.
  (void)google::protobuf::util::MessageToJsonString(value, &out);
  return out;
}

// The otherData of each rank a trace holds: its own, or a merged trace's
// list.
std::vector<const Struct*> RankData(const Struct& trace) {
  std::vector<const Struct*> out;
  const Struct* other = Object(trace, "otherData");
  if (other == nullptr) return out;
  const Value* ranks = Field(*other, "ranks");
  if (ranks != nullptr && ranks->kind_case() == Value::kListValue) {
    for (const Value& r : ranks->list_value().values()) {
      if (r.kind_case() == Value::kStructValue)
        out.push_back(&r.struct_value());
    }
  } else {
    out.push_back(other);
  }
  return out;
}

Value MetadataEvent(int pid, const std::string& name, const std::string& arg,
                    Value value) {
  Value event;
  auto& f = *event.mutable_struct_value()->mutable_fields();
  f["ph"].set_string_value("M");
  f["pid"].set_number_value(pid);
  f["name"].set_string_value(name);
  (*f["args"].mutable_struct_value()->mutable_fields())[arg] = std::move(value);
  return event;
}

// Sorted, disjoint [start, end) intervals in microseconds.
using Intervals = std::vector<std::pair<int64_t, int64_t>>;

Intervals Union(Intervals spans) {
  std::sort(spans.begin(), spans.end());
  Intervals out;
  for (const auto& [s, e] : spans) {
    if (e <= s) continue;
    if (!out.empty() && s <= out.back().second) {
      out.back().second = std::max(out.back().second, e);
    } else {
      out.emplace_back(s, e);
    }
  }
  return out;
}

Intervals Intersect(const Intervals& a, const Intervals& b) {
  Intervals out;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t s = std::max(a[i].first, b[j].first);
    const int64_t e = std::min(a[i].second, b[j].second);
    if (s < e) out.emplace_back(s, e);
    if (a[i].second < b[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return out;
}

// The time `u` covers within [from, to).
int64_t Measure(const Intervals& u, int64_t from, int64_t to) {
  auto it = std::lower_bound(u.begin(), u.end(), from,
                             [](const std::pair<int64_t, int64_t>& i,
                                int64_t t) { return i.second <= t; });
  int64_t total = 0;
  for (; it != u.end() && it->first < to; ++it) {
    total += std::min(it->second, to) - std::max(it->first, from);
  }
  return total;
}

int64_t Measure(const Intervals& u) {
  int64_t total = 0;
  for (const auto& [s, e] : u) total += e - s;
  return total;
}

struct StepSpan {
  int step;
  int64_t start;
  int64_t end;
};

struct Rank {
  std::vector<StepSpan> steps;
  Intervals compute;
  Intervals comm;
  int64_t first = INT64_MAX;
  int64_t last = INT64_MIN;
};

void Add(StepTimes& sum, const StepTimes& t) {
  sum.step_us += t.step_us;
  sum.compute_us += t.compute_us;
  sum.comm_us += t.comm_us;
  sum.exposed_us += t.exposed_us;
  sum.overlap_us += t.overlap_us;
  sum.other_us += t.other_us;
}

StepTimes Scaled(StepTimes t, double factor) {
  t.step_us *= factor;
  t.compute_us *= factor;
  t.comm_us *= factor;
  t.exposed_us *= factor;
  t.overlap_us *= factor;
  t.other_us *= factor;
  return t;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string Size(uint64_t bytes) {
  if (bytes >= (uint64_t{1} << 20)) {
    return absl::StrFormat("%.2fMiB", bytes / 1048576.0);
  }
  if (bytes >= 1024) return absl::StrFormat("%.1fKiB", bytes / 1024.0);
  return absl::StrCat(bytes, "B");
}

std::string Ms(double us) { return absl::StrFormat("%.3f", us / 1000); }

}  // namespace

absl::StatusOr<Struct> ParseTrace(absl::string_view name,
                                  absl::string_view json) {
  Struct trace;
  const auto parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &trace);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": not JSON: ", std::string(parsed.message())));
  }
  const Value* events = Field(trace, "traceEvents");
  if (events == nullptr || events->kind_case() != Value::kListValue) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": not a trace: no traceEvents array"));
  }
  const Struct* other = Object(trace, "otherData");
  if (other == nullptr || Field(*other, "cohort_trace") == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        name,
        ": not a cohort timeline (no otherData.cohort_trace): made by "
        "COHORT_TRACE, or by cohortctl trace merge"));
  }
  for (const Value& e : events->list_value().values()) {
    if (e.kind_case() != Value::kStructValue) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": a trace event is not an object: ", Json(e)));
    }
  }
  return trace;
}

absl::StatusOr<std::string> MergeTraces(absl::Span<const TraceText> traces) {
  std::map<int, std::string> rank_source;  // Rank -> the input it came from.
  std::vector<Value> rank_data;
  std::vector<std::pair<int, Value>> events;  // (rank, event)
  for (const TraceText& text : traces) {
    absl::StatusOr<Struct> trace = ParseTrace(text.name, text.json);
    if (!trace.ok()) return trace.status();
    const Struct& other = *Object(*trace, "otherData");
    const bool merged = Field(other, "ranks") != nullptr;
    const int own_rank = static_cast<int>(Number(other, "rank", -1));
    if (!merged && own_rank < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(text.name, ": otherData has no rank"));
    }
    for (const Struct* data : RankData(*trace)) {
      const int rank = static_cast<int>(Number(*data, "rank", -1));
      auto [it, added] = rank_source.emplace(rank, text.name);
      if (!added) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rank ", rank, " is in both ", it->second, " and ", text.name));
      }
      Value v;
      *v.mutable_struct_value() = *data;
      (*v.mutable_struct_value()->mutable_fields())["file"].set_string_value(
          text.name);
      rank_data.push_back(std::move(v));
    }
    for (const Value& e : Events(*trace).values()) {
      const Struct& event = e.struct_value();
      const std::string name = String(event, "name");
      if (String(event, "ph") == "M" &&
          (name == "process_name" || name == "process_sort_index")) {
        continue;  // Named again below, one name per rank.
      }
      const int rank =
          merged ? static_cast<int>(Number(event, "pid", -1)) : own_rank;
      Value copy = e;
      (*copy.mutable_struct_value()->mutable_fields())["pid"].set_number_value(
          rank);
      events.emplace_back(rank, std::move(copy));
    }
  }
  // Canonical order: by rank, metadata first, then by thread and start,
  // the longer span first at one start (its parent, for viewers that nest
  // spans in file order).
  auto key = [](const std::pair<int, Value>& e) {
    const Struct& f = e.second.struct_value();
    return std::make_tuple(e.first, String(f, "ph") != "M",
                           Number(f, "tid", -1), Number(f, "ts", -1),
                           -Number(f, "dur", 0));
  };
  std::stable_sort(
      events.begin(), events.end(),
      [&](const auto& a, const auto& b) { return key(a) < key(b); });
  std::string out = "{\"traceEvents\":[\n";
  std::vector<std::string> lines;
  for (const auto& [rank, source] : rank_source) {
    Value name, index;
    name.set_string_value(absl::StrCat("rank ", rank));
    index.set_number_value(rank);
    lines.push_back(Json(MetadataEvent(rank, "process_name", "name", name)));
    lines.push_back(
        Json(MetadataEvent(rank, "process_sort_index", "sort_index", index)));
  }
  for (const auto& [rank, event] : events) lines.push_back(Json(event));
  absl::StrAppend(&out, absl::StrJoin(lines, ",\n"));
  Value other;
  auto& f = *other.mutable_struct_value()->mutable_fields();
  f["cohort_trace"].set_number_value(1);
  f["merged"].set_bool_value(true);
  std::sort(rank_data.begin(), rank_data.end(),
            [](const Value& a, const Value& b) {
              return Number(a.struct_value(), "rank", -1) <
                     Number(b.struct_value(), "rank", -1);
            });
  for (Value& v : rank_data) {
    *f["ranks"].mutable_list_value()->add_values() = std::move(v);
  }
  absl::StrAppend(&out, "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":",
                  Json(other), "}\n");
  return out;
}

std::optional<double> BusBandwidthFactor(absl::string_view op, int ranks) {
  if (ranks < 1) return std::nullopt;
  const double n = ranks;
  if (op == "AllReduce") return 2 * (n - 1) / n;
  if (op == "AllGather" || op == "ReduceScatter" || op == "AllToAll") {
    return (n - 1) / n;
  }
  if (op == "Broadcast" || op == "Reduce" || op == "Send" || op == "Recv") {
    return 1.0;
  }
  return std::nullopt;
}

absl::StatusOr<TraceSummary> SummarizeTrace(const Struct& trace) {
  TraceSummary summary;
  std::map<int, Rank> ranks;
  using OpKey = std::tuple<std::string, std::string, uint64_t, int>;
  std::map<OpKey, std::vector<double>> op_durations;
  for (const Value& e : Events(trace).values()) {
    const Struct& event = e.struct_value();
    if (String(event, "ph") != "X") continue;
    const double pid = Number(event, "pid", -1);
    const double ts = Number(event, "ts", -1);
    const double dur = Number(event, "dur", -1);
    if (pid < 0 || ts < 0 || dur < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("a complete event without pid, ts or dur: ", Json(e)));
    }
    Rank& rank = ranks[static_cast<int>(pid)];
    const int64_t start = std::llround(ts);
    const int64_t end = start + std::llround(dur);
    rank.first = std::min(rank.first, start);
    rank.last = std::max(rank.last, end);
    const std::string cat = String(event, "cat");
    const Struct* args = Object(event, "args");
    if (cat == "step") {
      const double step = args != nullptr ? Number(*args, "step", -1) : -1;
      if (step < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("a step span without args.step: ", Json(e)));
      }
      rank.steps.push_back({static_cast<int>(step), start, end});
    } else if (cat == "compute") {
      summary.has_compute = true;
      rank.compute.emplace_back(start, end);
    } else if (cat == "comm") {
      if (args == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("a comm span without args: ", Json(e)));
      }
      const std::string state = String(*args, "state");
      if (state == "running" || state == "queued") {
        ++summary.unfinished_ops;
        continue;
      }
      rank.comm.emplace_back(start, end);
      if (state == "failed") {
        ++summary.failed_ops;
        continue;
      }
      op_durations[{String(*args, "op"), String(*args, "dtype"),
                    static_cast<uint64_t>(Number(*args, "bytes", 0)),
                    static_cast<int>(Number(*args, "ranks", 0))}]
          .push_back(dur);
    }
  }
  for (const Struct* data : RankData(trace)) {
    summary.dropped_ops +=
        static_cast<uint64_t>(Number(*data, "dropped_ops", 0));
  }

  std::map<int, std::pair<int, StepTimes>> steps;  // step -> (ranks, sum)
  for (auto& [id, rank] : ranks) {
    summary.ranks.push_back(id);
    const Intervals compute = Union(std::move(rank.compute));
    const Intervals comm = Union(std::move(rank.comm));
    const Intervals both = Intersect(compute, comm);
    RankSummary rs;
    rs.rank = id;
    rs.all_comm_us = static_cast<double>(Measure(comm));
    rs.span_us = static_cast<double>(rank.last - rank.first);
    for (const StepSpan& s : rank.steps) {
      StepTimes t;
      t.step_us = static_cast<double>(s.end - s.start);
      t.compute_us = static_cast<double>(Measure(compute, s.start, s.end));
      t.comm_us = static_cast<double>(Measure(comm, s.start, s.end));
      t.overlap_us = static_cast<double>(Measure(both, s.start, s.end));
      t.exposed_us = t.comm_us - t.overlap_us;
      t.other_us = t.step_us - t.compute_us - t.exposed_us;
      Add(rs.total, t);
      ++rs.steps;
      auto& [count, sum] = steps[s.step];
      ++count;
      Add(sum, t);
    }
    summary.per_rank.push_back(rs);
  }
  for (const auto& [step, entry] : steps) {
    summary.steps.push_back(
        {step, entry.first, Scaled(entry.second, 1.0 / entry.first)});
  }
  for (const auto& [key, durations] : op_durations) {
    OpSummary op;
    std::tie(op.op, op.dtype, op.bytes, op.ranks) = key;
    op.calls = static_cast<int>(durations.size());
    op.median_us = Median(durations);
    for (double d : durations) op.total_us += d;
    const std::optional<double> factor = BusBandwidthFactor(op.op, op.ranks);
    if (factor.has_value() && op.median_us >= 1) {
      const double size =
          static_cast<double>(op.bytes) * (op.op == "AllGather" ? op.ranks : 1);
      op.algbw_gbps = size / op.median_us / 1e3;  // bytes/us = 1e6 bytes/s.
      op.busbw_gbps = *op.algbw_gbps * *factor;
    }
    summary.ops.push_back(std::move(op));
  }
  return summary;
}

std::string FormatSummary(const TraceSummary& s) {
  std::string out = absl::StrFormat(
      "timeline: %d rank(s) (%s), %d step(s); ops: %d dropped by the "
      "recorder before they were read, %d unfinished, %d failed\n",
      static_cast<int>(s.ranks.size()), absl::StrJoin(s.ranks, ","),
      static_cast<int>(s.steps.size()), static_cast<int>(s.dropped_ops),
      s.unfinished_ops, s.failed_ops);
  auto header = [](absl::string_view first) {
    return absl::StrFormat("%10s %10s %10s %10s %10s %10s %10s %10s\n", first,
                           "step_ms", "compute_ms", "comm_ms", "exposed_ms",
                           "overlap_ms", "overlap%", "other_ms");
  };
  auto row = [](const std::string& first, const StepTimes& t) {
    const double share = t.comm_us > 0 ? 100 * t.overlap_us / t.comm_us : 0;
    return absl::StrFormat("%10s %10s %10s %10s %10s %10s %9.1f%% %10s\n",
                           first, Ms(t.step_us), Ms(t.compute_us),
                           Ms(t.comm_us), Ms(t.exposed_us), Ms(t.overlap_us),
                           share, Ms(t.other_us));
  };
  if (!s.has_compute) {
    absl::StrAppend(
        &out,
        "no compute spans: compute, exposed communication and overlap cannot "
        "be told (a torch backend trace holds communication alone: torch's "
        "compute, and its waits inside backward, are not visible to the "
        "backend)\n");
  }
  if (!s.steps.empty()) {
    absl::StrAppend(&out,
                    "\nper step, the mean over ranks (comm = exposed + "
                    "overlap; other = step - compute - exposed):\n",
                    header("step"));
    StepTimes all;
    for (const StepSummary& step : s.steps) {
      absl::StrAppend(&out, row(absl::StrCat(step.step), step.mean));
      Add(all, step.mean);
    }
    absl::StrAppend(&out, row("mean", Scaled(all, 1.0 / s.steps.size())));
    absl::StrAppend(&out, "\nper rank, the sum over its steps:\n",
                    header("rank"));
    for (const RankSummary& r : s.per_rank) {
      absl::StrAppend(&out, row(absl::StrCat(r.rank), r.total));
    }
  }
  absl::StrAppend(&out,
                  "\nper rank, the whole trace (comm inside steps or not):\n",
                  absl::StrFormat("%10s %10s %12s %12s\n", "rank", "steps",
                                  "all_comm_ms", "trace_ms"));
  for (const RankSummary& r : s.per_rank) {
    absl::StrAppend(&out,
                    absl::StrFormat("%10d %10d %12s %12s\n", r.rank, r.steps,
                                    Ms(r.all_comm_us), Ms(r.span_us)));
  }
  absl::StrAppend(
      &out,
      "\nper op (spans that ended OK, every rank; bytes: a rank's buffer, "
      "the input; time: the median span, start to end, waits for late peers "
      "included; algbw = size / time, size being bytes, all_gather's x "
      "ranks; GB/s = 1e9 B/s, as nccl-tests):\n",
      absl::StrFormat("%-14s %-5s %10s %5s %7s %11s %11s %11s %11s\n", "op",
                      "dtype", "bytes", "ranks", "calls", "median_us",
                      "total_ms", "algbw_GB/s", "busbw_GB/s"));
  for (const OpSummary& op : s.ops) {
    auto gbps = [](const std::optional<double>& v) {
      return v.has_value() ? absl::StrFormat("%.4g", *v) : std::string("-");
    };
    absl::StrAppend(
        &out, absl::StrFormat("%-14s %-5s %10s %5d %7d %11.0f %11s %11s %11s\n",
                              op.op, op.dtype, Size(op.bytes), op.ranks,
                              op.calls, op.median_us, Ms(op.total_us),
                              gbps(op.algbw_gbps), gbps(op.busbw_gbps)));
  }
  return out;
}

}  // namespace cohort

#include "worker/collective/trace/timeline.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "worker/collective/dtype.h"

namespace cohort {
namespace {

constexpr int kComputeTid = 1;
constexpr int kFirstCommTid = 10;
constexpr int kMaxLanes = 16;  // Per group; more would share the last.

int LaneTid(int group_id, int lane) {
  return kFirstCommTid + group_id * kMaxLanes + lane;
}

// The first lane whose spans all ended by `start` (a new one if none),
// extended to `end`.
int PickLane(std::vector<int64_t>& lane_ends, int64_t start, int64_t end) {
  for (size_t l = 0; l < lane_ends.size(); ++l) {
    if (lane_ends[l] <= start) {
      lane_ends[l] = end;
      return static_cast<int>(l);
    }
  }
  if (lane_ends.size() < kMaxLanes) {
    lane_ends.push_back(end);
  } else {
    lane_ends.back() = std::max(lane_ends.back(), end);
  }
  return static_cast<int>(lane_ends.size()) - 1;
}

// `text` as a JSON string, quotes included.
std::string Quote(absl::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  out += "\"";
  return out;
}

bool Finished(const FlightRecord& r) {
  return r.state == FlightState::kDone || r.state == FlightState::kFailed;
}

// mkdir -p.
absl::Status MakeDirs(const std::string& dir) {
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i < dir.size() && dir[i] != '/') continue;
    const std::string prefix = dir.substr(0, i);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot make the trace folder ", prefix, ": ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

std::string MetadataEvent(int pid, int tid, absl::string_view name,
                          absl::string_view arg, const std::string& value) {
  if (tid < 0) {
    return absl::StrCat("{\"ph\":\"M\",\"pid\":", pid, ",\"name\":\"", name,
                        "\",\"args\":{\"", arg, "\":", value, "}}");
  }
  return absl::StrCat("{\"ph\":\"M\",\"pid\":", pid, ",\"tid\":", tid,
                      ",\"name\":\"", name, "\",\"args\":{\"", arg,
                      "\":", value, "}}");
}

}  // namespace

int64_t Timeline::NowMicros() { return absl::GetCurrentTimeNanos() / 1000; }

absl::StatusOr<std::unique_ptr<Timeline>> Timeline::FromEnvironment(
    int rank, int world_size, absl::string_view source) {
  const char* dir = std::getenv(kTraceEnv);
  if (dir == nullptr || *dir == '\0') return std::unique_ptr<Timeline>();
  TimelineOptions options;
  options.dir = dir;
  options.rank = rank;
  options.world_size = world_size;
  options.source = std::string(source);
  return Open(std::move(options));
}

absl::StatusOr<std::unique_ptr<Timeline>> Timeline::Open(
    TimelineOptions options) {
  if (options.dir.empty()) {
    return absl::InvalidArgumentError("Timeline: no folder given");
  }
  if (options.rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Timeline: rank ", options.rank, " is negative"));
  }
  if (absl::Status s = MakeDirs(options.dir); !s.ok()) return s;
  std::unique_ptr<Timeline> timeline(new Timeline(std::move(options)));
  if (absl::Status s = timeline->Flush(); !s.ok()) return s;
  timeline->thread_ = std::thread([t = timeline.get()] { t->Run(); });
  return timeline;
}

Timeline::Timeline(TimelineOptions options)
    : options_(std::move(options)),
      path_(absl::StrCat(options_.dir, "/trace-rank", options_.rank, ".json")) {
  absl::MutexLock lock(&mu_);
  events_ =
      absl::StrCat(MetadataEvent(options_.rank, -1, "process_name", "name",
                                 Quote(absl::StrCat("rank ", options_.rank))),
                   ",\n",
                   MetadataEvent(options_.rank, -1, "process_sort_index",
                                 "sort_index", absl::StrCat(options_.rank)),
                   ",\n");
}

Timeline::~Timeline() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  if (absl::Status s = Flush(); !s.ok()) {
    std::fprintf(stderr, "cohort: trace: %s\n", s.ToString().c_str());
  }
}

void Timeline::Run() {
  absl::Time last_flush = absl::Now();
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.drain_every);
      if (stop_) return;
      for (Group& group : groups_) DrainLocked(group);
    }
    if (absl::Now() - last_flush < options_.flush_every) continue;
    last_flush = absl::Now();
    if (absl::Status s = Flush(); !s.ok()) {
      std::fprintf(stderr, "cohort: trace: %s\n", s.ToString().c_str());
    }
  }
}

int Timeline::AddGroup(absl::string_view name,
                       std::shared_ptr<const FlightRecorder> recorder,
                       int group_size) {
  if (recorder == nullptr) return -1;
  absl::MutexLock lock(&mu_);
  Group group;
  group.id = static_cast<int>(groups_.size());
  group.name = std::string(name);
  group.next = recorder->recorded();
  group.recorder = std::move(recorder);
  group.size = group_size;
  // Lane 0 is named now, so that a group shows even before its first op.
  const int tid = LaneTid(group.id, 0);
  AddEventLocked(MetadataEvent(options_.rank, tid, "thread_name", "name",
                               Quote(absl::StrCat("comm ", name))));
  AddEventLocked(MetadataEvent(options_.rank, tid, "thread_sort_index",
                               "sort_index", absl::StrCat(tid)));
  group.lanes_named = 1;
  groups_.push_back(std::move(group));
  return groups_.back().id;
}

void Timeline::RemoveGroup(int id) {
  absl::MutexLock lock(&mu_);
  if (id < 0 || id >= static_cast<int>(groups_.size())) return;
  Group& group = groups_[id];
  if (group.recorder == nullptr) return;
  DrainLocked(group);
  // What was still in flight is written as it stood.
  const int64_t now = NowMicros();
  for (const FlightRecord& r : group.in_flight) AddOpLocked(group, r, now);
  group.in_flight.clear();
  group.handled.clear();
  group.recorder = nullptr;
}

void Timeline::AddCompute(absl::string_view name, int64_t start_us,
                          int64_t end_us, int step, int layer) {
  std::string event = absl::StrCat(
      "{\"ph\":\"X\",\"pid\":", options_.rank, ",\"tid\":", kComputeTid,
      ",\"cat\":\"compute\",\"name\":", Quote(name), ",\"ts\":", start_us,
      ",\"dur\":", std::max<int64_t>(0, end_us - start_us), ",\"args\":{");
  absl::string_view comma = "";
  if (step >= 0) {
    absl::StrAppend(&event, "\"step\":", step);
    comma = ",";
  }
  if (layer >= 0) absl::StrAppend(&event, comma, "\"layer\":", layer);
  event += "}}";
  absl::MutexLock lock(&mu_);
  NameComputeLocked();
  AddEventLocked(std::move(event));
}

void Timeline::BeginStep(int step, int64_t start_us) {
  absl::MutexLock lock(&mu_);
  open_step_ = Step{step, start_us, 0};
}

void Timeline::EndStep(int64_t end_us) {
  absl::MutexLock lock(&mu_);
  if (!open_step_.has_value()) return;
  Step step = *open_step_;
  open_step_.reset();
  step.end_us = std::max(step.start_us, end_us);
  NameComputeLocked();
  AddEventLocked(absl::StrCat(
      "{\"ph\":\"X\",\"pid\":", options_.rank, ",\"tid\":", kComputeTid,
      ",\"cat\":\"step\",\"name\":\"step\",\"ts\":", step.start_us, ",\"dur\":",
      step.end_us - step.start_us, ",\"args\":{\"step\":", step.step, "}}"));
  steps_.push_back(step);
  for (Group& group : groups_) {
    if (group.recorder != nullptr && group.recorder->recorded() - group.next >
                                         group.recorder->capacity() / 2) {
      DrainLocked(group);
    }
  }
}

void Timeline::NameComputeLocked() {
  if (compute_named_) return;
  compute_named_ = true;
  absl::StrAppend(&events_,
                  MetadataEvent(options_.rank, kComputeTid, "thread_name",
                                "name", "\"compute\""),
                  ",\n",
                  MetadataEvent(options_.rank, kComputeTid, "thread_sort_index",
                                "sort_index", absl::StrCat(kComputeTid)),
                  ",\n");
}

void Timeline::AddEventLocked(std::string event) {
  if (event_count_ >= options_.max_events) {
    ++dropped_events_;
    return;
  }
  ++event_count_;
  absl::StrAppend(&events_, event, ",\n");
}

int Timeline::StepAt(int64_t us) const {
  if (open_step_.has_value() && us >= open_step_->start_us) {
    return open_step_->step;
  }
  // The last step that started at or before `us`.
  auto it =
      std::upper_bound(steps_.begin(), steps_.end(), us,
                       [](int64_t t, const Step& s) { return t < s.start_us; });
  if (it == steps_.begin()) return -1;
  --it;
  return us <= it->end_us ? it->step : -1;
}

void Timeline::AppendOp(const Group& group, const FlightRecord& r,
                        int64_t now_us, std::vector<int64_t>& lane_ends,
                        int lanes_named, std::string& out) const {
  // An op not yet started is drawn from when it was queued.
  const int64_t start = r.started_us > 0 ? r.started_us : r.enqueued_us;
  const int64_t end = std::max(start, r.ended_us > 0 ? r.ended_us : now_us);
  const int lane = PickLane(lane_ends, start, end);
  const int tid = LaneTid(group.id, lane);
  if (lane >= lanes_named) {
    absl::StrAppend(
        &out,
        MetadataEvent(options_.rank, tid, "thread_name", "name",
                      Quote(absl::StrCat("comm ", group.name, " #", lane + 1))),
        ",\n",
        MetadataEvent(options_.rank, tid, "thread_sort_index", "sort_index",
                      absl::StrCat(tid)),
        ",\n");
  }
  const uint64_t bytes = r.count * DtypeSize(r.dtype);
  absl::StrAppend(&out, "{\"ph\":\"X\",\"pid\":", options_.rank,
                  ",\"tid\":", tid, ",\"cat\":\"comm\",\"name\":\"", r.op,
                  "\",\"ts\":", start, ",\"dur\":", end - start,
                  ",\"args\":{\"op\":\"", r.op, "\",\"seq\":", r.seq,
                  ",\"dtype\":\"", DtypeName(r.dtype), "\",\"count\":", r.count,
                  ",\"bytes\":", bytes, ",\"ranks\":", group.size,
                  ",\"queued_us\":", r.enqueued_us);
  if (r.is_reduction) {
    absl::StrAppend(&out, ",\"reduce\":\"", ReduceOpName(r.reduce), "\"");
  }
  if (r.root >= 0) {
    const bool p2p = r.op == "Send" || r.op == "Recv";
    absl::StrAppend(&out, p2p ? ",\"peer\":" : ",\"root\":", r.root);
  }
  if (const int step = StepAt(r.enqueued_us); step >= 0) {
    absl::StrAppend(&out, ",\"step\":", step);
  }
  absl::StrAppend(&out, ",\"state\":\"", FlightStateName(r.state), "\"");
  if (!r.error.empty()) absl::StrAppend(&out, ",\"error\":", Quote(r.error));
  out += "}}";
}

void Timeline::AddOpLocked(Group& group, const FlightRecord& r,
                           int64_t now_us) {
  std::string event;
  AppendOp(group, r, now_us, group.lane_ends, group.lanes_named, event);
  group.lanes_named =
      std::max(group.lanes_named, static_cast<int>(group.lane_ends.size()));
  AddEventLocked(std::move(event));  // With the lane's name when new.
}

void Timeline::DrainLocked(Group& group) {
  if (group.recorder == nullptr) return;
  const std::vector<FlightRecord> records = group.recorder->Snapshot();
  const uint64_t recorded = group.recorder->recorded();
  const uint64_t capacity = group.recorder->capacity();
  group.in_flight.clear();
  const int64_t now = NowMicros();
  // Walks the indices from `next` in order; `blocked` once one is still in
  // flight (or still being written), after which `next` stays put and the
  // ops handled are remembered in `handled`.
  bool blocked = false;
  uint64_t i = group.next;
  auto handle = [&](uint64_t index) {
    if (blocked) {
      group.handled.insert(index);
    } else {
      group.next = index + 1;
      group.handled.erase(index);
    }
  };
  auto missing = [&](uint64_t index) {
    if (group.handled.contains(index)) {
      if (!blocked) handle(index);
    } else if (index + capacity <= recorded) {
      ++dropped_ops_;  // Overwritten before it was read.
      handle(index);
    } else {
      blocked = true;  // Being written as the snapshot read it.
    }
  };
  for (const FlightRecord& r : records) {
    if (r.index < i) continue;
    for (; i < r.index; ++i) missing(i);
    i = r.index + 1;
    if (group.handled.contains(r.index)) {
      if (!blocked) handle(r.index);
    } else if (Finished(r)) {
      AddOpLocked(group, r, now);
      handle(r.index);
    } else {
      group.in_flight.push_back(r);
      blocked = true;
    }
  }
}

std::string Timeline::ContentsLocked() const {
  std::string out = "{\"traceEvents\":[\n";
  out += events_;
  const int64_t now = NowMicros();
  for (const Group& group : groups_) {
    // Lanes for ops in flight are picked again at each write.
    std::vector<int64_t> lane_ends = group.lane_ends;
    for (const FlightRecord& r : group.in_flight) {
      AppendOp(group, r, now, lane_ends, group.lanes_named, out);
      out += ",\n";
    }
  }
  if (absl::EndsWith(out, ",\n")) out.resize(out.size() - 2);
  absl::StrAppend(&out, "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":{",
                  "\"cohort_trace\":1,\"rank\":", options_.rank,
                  ",\"world_size\":", options_.world_size,
                  ",\"source\":", Quote(options_.source),
                  ",\"host_pid\":", ::getpid(), ",\"written_us\":", now,
                  ",\"dropped_ops\":", dropped_ops_,
                  ",\"dropped_events\":", dropped_events_, "}}\n");
  return out;
}

absl::Status Timeline::Flush() {
  // write_mu_ before mu_: the file is written in the order of the contents.
  absl::MutexLock write_lock(&write_mu_);
  std::string contents;
  {
    absl::MutexLock lock(&mu_);
    for (Group& group : groups_) DrainLocked(group);
    contents = ContentsLocked();
  }
  return Write(contents);
}

absl::Status Timeline::Write(const std::string& contents) {
  const std::string tmp = absl::StrCat(path_, ".tmp");
  std::FILE* file = std::fopen(tmp.c_str(), "w");
  if (file == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  }
  const size_t wrote = std::fwrite(contents.data(), 1, contents.size(), file);
  const bool closed = std::fclose(file) == 0;
  if (wrote != contents.size() || !closed) {
    std::remove(tmp.c_str());
    return absl::DataLossError(
        absl::StrCat("cannot write ", tmp, " (", std::strerror(errno), ")"));
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot rename ", tmp, " to ", path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace cohort

#include "server/status/status_view.h"

#include <algorithm>
#include <map>

#include "server/status/json_writer.h"

namespace cohort::server {
namespace {

int64_t UnixMillis(absl::Time t) { return absl::ToUnixMillis(t); }

int64_t Millis(absl::Duration d) {
  return std::max<int64_t>(0, absl::ToInt64Milliseconds(d));
}

absl::Duration LeaseTimeout(const v1::MemberInfo& info) {
  return absl::Milliseconds(info.heartbeat_interval_ms()) *
         info.missed_heartbeats();
}

const char* FindingKind(flight::Finding::Kind kind) {
  switch (kind) {
    case flight::Finding::Kind::kHang:
      return "hang";
    case flight::Finding::Kind::kMismatch:
      return "mismatch";
    case flight::Finding::Kind::kArgumentMismatch:
      return "argument_mismatch";
    case flight::Finding::Kind::kDead:
      return "dead";
    case flight::Finding::Kind::kFailed:
      return "failed";
    case flight::Finding::Kind::kStraggler:
      return "straggler";
  }
  return "unknown";
}

void WriteDiagnosis(JsonWriter& w, const RunDiagnosis& d) {
  w.BeginObject()
      .Field("round", d.round)
      .Field("as_of_unix_ms", UnixMillis(d.as_of))
      .Key("errors")
      .BeginArray();
  for (const std::string& e : d.errors) w.String(e);
  w.EndArray().Key("groups").BeginArray();
  for (const flight::GroupDiagnosis& g : d.groups) {
    w.BeginObject()
        .Field("group", g.group)
        .Field("ranks_dumped", g.ranks_dumped)
        .Field("text", g.diagnosis.Text())
        .Key("findings")
        .BeginArray();
    for (const flight::Finding& f : g.diagnosis.findings) {
      w.BeginObject().Field("kind", FindingKind(f.kind)).Key("ranks");
      w.BeginArray();
      for (int rank : f.ranks) w.Int(rank);
      w.EndArray()
          .Field("seq", static_cast<int64_t>(f.seq))
          .Field("sentence", f.sentence)
          .EndObject();
    }
    w.EndArray().EndObject();
  }
  w.EndArray().EndObject();
}

void WriteRun(JsonWriter& w, const RunView& run) {
  const v1::RunState& s = run.state;
  w.BeginObject()
      .Field("run", run.run)
      .Field("phase", v1::RunState::Phase_Name(s.phase()))
      .Field("round", s.round())
      .Field("min_nodes", s.min_nodes())
      .Field("max_nodes", s.max_nodes())
      .Field("num_nodes", s.num_participants())
      .Field("num_waiting", s.num_waiting())
      .Key("nodes")
      .BeginArray();
  for (const v1::Participant& p : run.nodes) {
    w.BeginObject()
        .Field("node_id", p.node_id())
        .Field("address", p.address())
        .Field("node_rank", p.node_rank())
        .Field("local_world_size", p.local_world_size())
        .Field("first_global_rank", p.first_global_rank())
        .EndObject();
  }
  w.EndArray().Field(
      "nodes_unlisted",
      std::max<int64_t>(
          0, s.num_participants() - static_cast<int64_t>(run.nodes.size())));
  if (run.keys.has_value()) w.Field("keys", *run.keys);
  w.Key("diagnosis");
  if (run.diagnosis.has_value()) {
    WriteDiagnosis(w, *run.diagnosis);
  } else {
    w.Null();
  }
  w.EndObject();
}

void WriteMember(JsonWriter& w, const MemberSnapshot& m, absl::Time now) {
  w.BeginObject()
      .Field("name", m.info.name())
      .Field("rank", m.info.rank())
      .Field("host", m.info.host())
      .Field("incarnation", m.info.incarnation())
      .Field("state", MemberState(m))
      .Field("message", m.message)
      .Field("heartbeat_interval_ms", m.info.heartbeat_interval_ms())
      .Field("missed_heartbeats", m.info.missed_heartbeats())
      .Field("last_heartbeat_ms_ago", Millis(now - LastRenewal(m)))
      .Field("lease_left_ms", m.alive ? Millis(m.lease_end - now) : 0)
      .EndObject();
}

void WriteGroup(JsonWriter& w, const GroupSnapshot& g, absl::Time now) {
  w.BeginObject()
      .Field("group", g.group)
      .Field("members_total", g.members)
      .Field("members_alive", g.alive)
      .Field("members_unlisted", g.members - g.listed.size())
      .Key("members")
      .BeginArray();
  for (const MemberSnapshot& m : g.listed) WriteMember(w, m, now);
  w.EndArray().Key("barriers").BeginArray();
  for (const BarrierSnapshot& b : g.barriers) {
    w.BeginObject()
        .Field("barrier", b.id)
        .Field("generation", b.generation)
        .Field("participants", b.participants)
        .Field("arrived", b.arrived)
        .Key("missing")
        .BeginArray();
    for (const v1::MemberInfo& m : b.missing) {
      w.BeginObject()
          .Field("name", m.name())
          .Field("rank", m.rank())
          .Field("host", m.host())
          .EndObject();
    }
    w.EndArray()
        .Field("missing_unlisted", b.missing_unlisted)
        .Field("waiting_ms", Millis(now - b.started))
        .Field("timeout_ms", Millis(b.timeout))
        .EndObject();
  }
  w.EndArray().EndObject();
}

}  // namespace

const char* MemberState(const MemberSnapshot& member) {
  if (member.alive) {
    return member.last_event == v1::MemberEvent::ERROR_REPORTED ? "error"
                                                                : "alive";
  }
  return member.last_event == v1::MemberEvent::LEFT ? "left" : "failed";
}

absl::Time LastRenewal(const MemberSnapshot& member) {
  return member.lease_end - LeaseTimeout(member.info);
}

std::string StatusJson(const StatusView& view) {
  JsonWriter w;
  w.BeginObject()
      .Field("time_unix_ms", UnixMillis(view.now))
      .Field("revision", view.revision);
  if (view.keys.has_value()) w.Field("keys", *view.keys);
  w.Field("coordinating", view.coordinating)
      .Field("viewer", view.viewer)
      .Key("runs")
      .BeginArray();
  for (const RunView& run : view.runs) WriteRun(w, run);
  w.EndArray()
      .Field("runs_unlisted", view.runs_unlisted)
      .Key("groups")
      .BeginArray();
  for (const GroupSnapshot& g : view.groups) WriteGroup(w, g, view.now);
  w.EndArray().Field("groups_unlisted", view.groups_unlisted).EndObject();
  return w.text();
}

RunDiagnosis DiagnoseDumps(
    const std::vector<std::pair<std::string, std::string>>& dumps,
    const GroupSnapshot* group, absl::Time now) {
  RunDiagnosis out;
  out.as_of = now;
  std::vector<v1::FlightDump> parsed;
  for (const auto& [key, value] : dumps) {
    absl::StatusOr<v1::FlightDump> dump = flight::DecodeFlightDump(key, value);
    if (!dump.ok()) {
      out.errors.emplace_back(dump.status().message());
      continue;
    }
    parsed.push_back(std::move(*dump));
  }
  std::map<std::string, flight::Liveness> by_node;
  if (group != nullptr) {
    for (const MemberSnapshot& m : group->listed) {
      by_node[m.info.name()] = {.alive = m.alive,
                                .since_heartbeat = now - LastRenewal(m)};
    }
  }
  out.groups = flight::DiagnoseRun(parsed, by_node);
  if (!out.groups.empty()) out.round = out.groups.front().round;
  return out;
}

}  // namespace cohort::server

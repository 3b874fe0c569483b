// store_history: a recorded store workload for the linearizability checker
// (tests/robustness/lincheck). Each client is a thread with a connection of
// its own (RemoteStore, with its real retry policy) that runs random c10d
// operations, one at a time, on a few small key groups, and records each
// one's invocation and completion (wall clock, ns) with its result:
//   ok       the answer arrived;
//   unknown  a write whose answer was lost or refused in a way that does
//            not prove it had no effect (it may apply at any later time);
//   fail     a read that ended without an answer, or a write refused
//            before it could apply (bad argument, permission): no effect.
// The history is written as JSON Lines (lincheck/README.md) when the run
// ends: after --seconds, or at SIGTERM/SIGINT once every client has
// finished its operation in flight.
//
// Keys are "<prefix>e<E>g<G>/<name>": names a, b, c hold strings, n a
// counter; multi-key operations stay inside one group, so the checker can
// split the history by group. E is the wall clock in --epoch_seconds (the
// same in every process on the machine): the clients move to fresh groups
// every few seconds, so a long run makes many short groups, each as
// contended as a short run's, where porcupine's cost stays small. Values
// are unique ("c<client>-<n>").
//
//   store_history --targets='IP:PORT;IP:PORT;IP:PORT,IP:PORT' --clients=6 \
//     --seconds=20 --out=history.jsonl
// Client i records as process 1000 * (client_base + i) + g, where g counts
// its unknown writes so far. Client i talks to targets[i % count] (a comma list fails over, as
// RemoteStore does). A client whose call fails pauses --backoff_ms, doubled
// while failures go on (up to 1 s).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/signals.h"
#include "client/remote_store.h"

ABSL_FLAG(std::string, targets, "",
          "cohortd addresses, ';'-separated; each may be a comma list");
ABSL_FLAG(int, clients, 6, "concurrent clients");
ABSL_FLAG(int, client_base, 0, "id of the first client (unique across files)");
ABSL_FLAG(int, groups, 4, "key groups");
ABSL_FLAG(std::string, prefix, "/lin/", "key prefix");
ABSL_FLAG(int, epoch_seconds, 5,
          "keys move to a fresh set every so many seconds of wall time");
ABSL_FLAG(double, seconds, 10, "run time; 0 runs until SIGTERM");
ABSL_FLAG(int, op_timeout_ms, 500, "timeout of blocking get/wait/multi_get");
ABSL_FLAG(int, rpc_timeout_ms, 3000, "deadline of each call");
ABSL_FLAG(int, max_attempts, 3, "RemoteStore's attempts of retryable calls");
ABSL_FLAG(int, backoff_ms, 100, "pause after a failed call");
ABSL_FLAG(uint64_t, seed, 0, "random seed (0: from the clock)");
ABSL_FLAG(std::string, out, "", "history file (JSON Lines)");

namespace {

struct Op {
  int client = 0;
  int target = 0;
  std::string op;
  std::vector<std::string> keys;
  std::vector<std::string> values;
  int64_t call = 0;
  int64_t ret = 0;
  std::string status;  // ok, unknown, fail
  std::string out;     // JSON text of the result; empty when none.
  std::string error;
};

std::string Json(absl::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      absl::StrAppend(&out, "\\u00", absl::Hex(c, absl::kZeroPad2));
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string JsonList(const std::vector<std::string>& items) {
  std::vector<std::string> quoted;
  for (const std::string& s : items) quoted.push_back(Json(s));
  return absl::StrCat("[", absl::StrJoin(quoted, ","), "]");
}

std::string Line(const Op& op) {
  std::string line = absl::StrCat(
      "{\"client\":", op.client, ",\"target\":", op.target,
      ",\"op\":", Json(op.op), ",\"keys\":", JsonList(op.keys),
      ",\"values\":", JsonList(op.values), ",\"call\":", op.call,
      ",\"return\":", op.ret, ",\"status\":", Json(op.status));
  if (!op.out.empty()) absl::StrAppend(&line, ",\"out\":", op.out);
  if (!op.error.empty()) absl::StrAppend(&line, ",\"error\":", Json(op.error));
  return line + "}\n";
}

bool IsWrite(absl::string_view op) {
  return op == "set" || op == "add" || op == "cas" || op == "delete" ||
         op == "multi_set" || op == "append";
}

// Refusals that prove a write had no effect; any other error may hide an
// applied write whose answer was lost.
bool ProvesNoEffect(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsPermissionDenied(s) ||
         absl::IsFailedPrecondition(s) || absl::IsOutOfRange(s) ||
         absl::IsUnauthenticated(s);
}

class Client {
 public:
  Client(int id, int target, std::shared_ptr<cohort::RemoteStore> store,
         uint64_t seed)
      : id_(id), target_(target), store_(std::move(store)), rng_(seed) {}

  // Runs operations until `stop`; returns the history.
  std::vector<Op> Run(const std::atomic<bool>& stop) {
    std::vector<Op> history;
    while (!stop.load()) {
      Op op = Next();
      op.client = id_ * 1000 + generation_;
      op.target = target_;
      op.call = absl::GetCurrentTimeNanos();
      absl::Status s = Apply(&op);
      op.ret = absl::GetCurrentTimeNanos();
      if (s.ok()) {
        op.status = "ok";
      } else {
        op.out.clear();
        op.error = s.ToString();
        op.status = IsWrite(op.op) && !ProvesNoEffect(s) ? "unknown" : "fail";
        // An unknown write may still apply at any later time: as in
        // Jepsen, the client goes on as a new process so that its own
        // operations never overlap.
        if (op.status == "unknown") ++generation_;
      }
      history.push_back(std::move(op));
      // Doubling pauses while calls fail (up to 1 s), so that an outage
      // yields a few unknown writes rather than hundreds.
      failures_ = s.ok() ? 0 : std::min(failures_ + 1, 4);
      if (failures_ > 0) {
        absl::SleepFor(absl::Milliseconds(
            std::min(1000, absl::GetFlag(FLAGS_backoff_ms) << (failures_ - 1))));
      }
    }
    return history;
  }

 private:
  int Pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }
  std::string Key(int group, absl::string_view name) {
    return absl::StrCat(absl::GetFlag(FLAGS_prefix), "e", epoch_, "g", group,
                        "/", name);
  }
  std::string Fresh() { return absl::StrCat("c", id_, "-", ++seq_); }
  std::string StringKey(int group) {
    static constexpr const char* kNames[] = {"a", "b", "c"};
    return Key(group, kNames[Pick(3)]);
  }

  // A random operation with its arguments.
  Op Next() {
    Op op;
    epoch_ = absl::GetCurrentTimeNanos() /
             (int64_t{1000000000} * absl::GetFlag(FLAGS_epoch_seconds));
    const int group = Pick(absl::GetFlag(FLAGS_groups));
    const int dice = Pick(100);
    if (dice < 18) {
      op.op = "set";
      op.keys = {StringKey(group)};
      op.values = {Fresh()};
    } else if (dice < 33) {
      op.op = "get";
      op.keys = {Pick(4) == 0 ? Key(group, "n") : StringKey(group)};
    } else if (dice < 41) {
      op.op = "check";
      op.keys = {StringKey(group)};
      if (Pick(2) == 0) op.keys.push_back(Key(group, "n"));
    } else if (dice < 56) {
      op.op = "add";
      op.keys = {Key(group, "n")};
      op.values = {absl::StrCat(1 + Pick(5))};
    } else if (dice < 66) {
      op.op = "cas";
      op.keys = {StringKey(group)};
      auto seen = last_seen_.find(op.keys[0]);
      const bool guess = seen != last_seen_.end() && Pick(3) != 0;
      op.values = {guess ? seen->second : (Pick(2) == 0 ? "" : "c0-1"), Fresh()};
    } else if (dice < 71) {
      op.op = "delete";
      op.keys = {StringKey(group)};
    } else if (dice < 76) {
      op.op = "wait";
      op.keys = {Key(group, "a"), Key(group, "b")};
    } else if (dice < 88) {
      op.op = "multi_get";
      op.keys = {Key(group, "a"), Key(group, "b")};
      if (Pick(2) == 0) op.keys.push_back(Key(group, "n"));
    } else if (dice < 96) {
      op.op = "multi_set";
      op.keys = {Key(group, "a"), Key(group, "b")};
      if (Pick(2) == 0) op.keys.push_back(Key(group, "c"));
      for (size_t i = 0; i < op.keys.size(); ++i) op.values.push_back(Fresh());
    } else {
      op.op = "append";
      op.keys = {StringKey(group)};
      op.values = {absl::StrCat("+", id_, ".", ++seq_)};
    }
    return op;
  }

  absl::Status Apply(Op* op) {
    const absl::Duration wait = absl::Milliseconds(absl::GetFlag(FLAGS_op_timeout_ms));
    const std::string& key = op->keys[0];
    if (op->op == "set") return store_->Set(key, op->values[0]);
    if (op->op == "get") {
      absl::StatusOr<std::string> v = store_->Get(key, wait);
      if (!v.ok()) return v.status();
      op->out = Json(*v);
      last_seen_[key] = *v;
      return absl::OkStatus();
    }
    if (op->op == "check") {
      absl::StatusOr<bool> v = store_->Check(op->keys);
      if (!v.ok()) return v.status();
      op->out = *v ? "true" : "false";
      return absl::OkStatus();
    }
    if (op->op == "add") {
      absl::StatusOr<int64_t> v = store_->Add(key, std::stoll(op->values[0]));
      if (!v.ok()) return v.status();
      op->out = absl::StrCat(*v);
      return absl::OkStatus();
    }
    if (op->op == "cas") {
      absl::StatusOr<std::string> v =
          store_->CompareSet(key, op->values[0], op->values[1]);
      if (!v.ok()) return v.status();
      op->out = Json(*v);
      last_seen_[key] = *v;
      return absl::OkStatus();
    }
    if (op->op == "delete") {
      absl::StatusOr<bool> v = store_->DeleteKey(key);
      if (!v.ok()) return v.status();
      op->out = *v ? "true" : "false";
      return absl::OkStatus();
    }
    if (op->op == "wait") return store_->Wait(op->keys, wait);
    if (op->op == "multi_get") {
      absl::StatusOr<std::vector<std::string>> v = store_->MultiGet(op->keys, wait);
      if (!v.ok()) return v.status();
      op->out = JsonList(*v);
      for (size_t i = 0; i < v->size(); ++i) last_seen_[op->keys[i]] = (*v)[i];
      return absl::OkStatus();
    }
    if (op->op == "multi_set") return store_->MultiSet(op->keys, op->values);
    return store_->Append(key, op->values[0]);
  }

  const int id_;
  const int target_;
  std::shared_ptr<cohort::RemoteStore> store_;
  std::mt19937_64 rng_;
  int64_t seq_ = 0;
  int generation_ = 0;
  int failures_ = 0;  // In a row.
  int64_t epoch_ = 0;
  std::map<std::string, std::string> last_seen_;
};

cohort::RemoteStoreOptions Options(const std::string& address) {
  cohort::RemoteStoreOptions options;
  options.address = address;
  options.connect_timeout = absl::Seconds(20);
  options.rpc_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_rpc_timeout_ms));
  options.max_attempts = absl::GetFlag(FLAGS_max_attempts);
  options.max_backoff = absl::Milliseconds(200);
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  const sigset_t stop_signals = cohort::base::BlockStopSignals();
  absl::ParseCommandLine(argc, argv);
  const std::vector<std::string> targets =
      absl::StrSplit(absl::GetFlag(FLAGS_targets), ';', absl::SkipEmpty());
  const std::string out_path = absl::GetFlag(FLAGS_out);
  if (targets.empty() || out_path.empty() || absl::GetFlag(FLAGS_clients) < 1 ||
      absl::GetFlag(FLAGS_groups) < 1) {
    std::fprintf(stderr,
                 "store_history: needs --targets, --out, --clients >= 1 and "
                 "--groups >= 1\n");
    return 2;
  }
  uint64_t seed = absl::GetFlag(FLAGS_seed);
  if (seed == 0) seed = static_cast<uint64_t>(absl::GetCurrentTimeNanos());
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < absl::GetFlag(FLAGS_clients); ++i) {
    const int target = i % static_cast<int>(targets.size());
    auto store = cohort::RemoteStore::Connect(Options(targets[target]));
    if (!store.ok()) {
      std::fprintf(stderr, "store_history: client %d: %s\n", i,
                   store.status().ToString().c_str());
      return 1;
    }
    clients.push_back(std::make_unique<Client>(
        absl::GetFlag(FLAGS_client_base) + i, target,
        std::shared_ptr<cohort::RemoteStore>(std::move(*store)), seed + i));
  }

  std::atomic<bool> stop{false};
  std::vector<std::vector<Op>> histories(clients.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < clients.size(); ++i) {
    threads.emplace_back([&, i] { histories[i] = clients[i]->Run(stop); });
  }
  std::thread waiter([&] {
    const double seconds = absl::GetFlag(FLAGS_seconds);
    if (seconds > 0) {
      siginfo_t info;
      const timespec limit = absl::ToTimespec(absl::Seconds(seconds));
      sigtimedwait(&stop_signals, &info, &limit);
    } else {
      int signal = 0;
      sigwait(&stop_signals, &signal);
    }
    stop = true;
  });
  waiter.join();
  for (std::thread& t : threads) t.join();

  std::FILE* out = std::fopen(out_path.c_str(), "w");
  if (out == nullptr) {
    std::fprintf(stderr, "store_history: cannot write %s\n", out_path.c_str());
    return 1;
  }
  std::map<std::string, int64_t> counts;
  for (const std::vector<Op>& history : histories) {
    for (const Op& op : history) {
      std::fputs(Line(op).c_str(), out);
      ++counts[absl::StrCat("target", op.target, " ", op.status)];
    }
  }
  const bool written = std::fclose(out) == 0;
  std::vector<std::string> parts;
  for (const auto& [what, n] : counts) parts.push_back(absl::StrCat(what, "=", n));
  std::printf("store_history: %s: %s\n", out_path.c_str(),
              absl::StrJoin(parts, " ").c_str());
  return written ? 0 : 1;
}

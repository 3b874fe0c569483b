#include "tests/testing/kill_trials.h"

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cohort/v1/store.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "proto/rpc/grpc_status.h"
#include "tests/testing/cohortd_process.h"

namespace cohort::testing {
namespace {

// A key's content; nullopt: the key does not exist.
using State = std::optional<std::string>;

constexpr char kPrefix[] = "kt/";
constexpr int kCounters = 4;
constexpr int kBigSlots = 4;
constexpr size_t kMaxLogBytes = 4096;
constexpr size_t kMaxFailures = 20;
constexpr absl::Duration kRpcDeadline = absl::Seconds(60);
// Verification reads at most this many value bytes per MultiGet, well under
// cohortd's 64 MiB message limit.
constexpr size_t kReadBatchBytes = 16 << 20;
constexpr size_t kReadBatchKeys = 4096;

std::string CounterKey(int c) { return absl::StrCat(kPrefix, "ctr/", c); }

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t Fnv(absl::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// The value `key` holds at generation `gen`: it names both, then
// pseudo-random bytes up to `size`, so a value found under the wrong key or
// from another write can never compare equal.
std::string ValueFor(absl::string_view key, uint64_t gen, size_t size) {
  std::string value = absl::StrCat(key, "@", gen, ":");
  value.reserve(std::max(size, value.size()));
  uint64_t x = Fnv(key) ^ Mix(gen);
  while (value.size() < size) {
    x = Mix(x);
    for (int i = 0; i < 8 && value.size() < size; ++i) {
      value.push_back(static_cast<char>(x >> (8 * i)));
    }
  }
  return value;
}

std::string Describe(const State& s) {
  if (!s.has_value()) return "absent";
  std::string head = absl::CEscape(s->substr(0, 48));
  return absl::StrCat(s->size(), " bytes \"", head,
                      s->size() > 48 ? "...\"" : "\"");
}

// What the acknowledged writes left in one key, and what the one call that
// may have been in flight at the kill would leave instead.
struct KeyModel {
  State acked;
  std::vector<State> maybe;
  // Candidate for Delete and MultiSet overwrites (the small keys).
  bool small = false;
  // The last acknowledged write's kind, for messages.
  std::string last = "verified";
};

// Failures found by a writer thread or the checker, merged into the report.
struct Findings {
  int64_t lost = 0;
  int64_t anomalies = 0;
  std::vector<std::string> failures;

  void Lost(std::string what) {
    ++lost;
    Note(std::move(what));
  }
  void Anomaly(std::string what) {
    ++anomalies;
    Note(std::move(what));
  }
  void Note(std::string what) {
    if (failures.size() < kMaxFailures) failures.push_back(std::move(what));
  }
};

struct Counts {
  int64_t sets = 0, big_sets = 0, multisets = 0, multiset_keys = 0, appends = 0,
          adds = 0, add_delta_sum = 0, deletes = 0, compare_sets = 0,
          compare_sets_swapped = 0, in_flight = 0;
};

// One client thread's keys and acknowledged history. Its keys are its own
// (kt/w<id>/...), so each key's writes are sequential and the model knows
// every key's exact content, up to the one call in flight at the kill. The
// counters are shared by all writers.
class Writer {
 public:
  Writer(int id, uint64_t seed, const KillTrialOptions& options)
      : id_(id), options_(options), rng_(seed) {}

  // Writes until the first call that fails (the kill), against `address`.
  // `base` holds the counters' verified values, `revision` the store's.
  // Counts each acknowledged write in `acked`, and itself in `done` at the
  // end.
  void Run(const std::string& address, int trial, const int64_t* base,
           int64_t revision, const std::atomic<bool>* killing,
           std::atomic<int64_t>* acked, std::atomic<int>* done) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    // Retries would blur which attempt was acknowledged.
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    stub_ = v1::Store::NewStub(grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), args));
    trial_ = trial;
    base_ = base;
    killing_ = killing;
    last_revision_ = revision;
    for (int c = 0; c < kCounters; ++c)
      acked_delta_[c] = in_flight_delta_[c] = 0;
    in_flight_multiset_.clear();
    while (Step()) ++*acked;
    stub_.reset();
    ++*done;
  }

  std::map<std::string, KeyModel>& keys() { return keys_; }
  const std::vector<std::pair<std::string, std::string>>& in_flight_multiset()
      const {
    return in_flight_multiset_;
  }
  int64_t acked_delta(int c) const { return acked_delta_[c]; }
  int64_t in_flight_delta(int c) const { return in_flight_delta_[c]; }
  int64_t max_revision() const { return last_revision_; }
  Counts& counts() { return counts_; }
  Findings& findings() { return findings_; }

  // After a verification: the model holds what the store holds.
  void Rebuild() {
    live_.clear();
    for (const auto& [key, m] : keys_) {
      if (m.small && m.acked.has_value()) live_.push_back(key);
    }
  }

 private:
  template <typename Request, typename Response>
  grpc::Status Call(grpc::Status (v1::Store::Stub::*method)(
                        grpc::ClientContext*, const Request&, Response*),
                    const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kRpcDeadline));
    return (stub_.get()->*method)(&context, request, response);
  }

  // One random write; false once a call has failed.
  bool Step() {
    std::uniform_real_distribution<double> unit(0, 1);
    if (unit(rng_) < options_.big_value_fraction) return BigSet();
    if (static_cast<int>(live_.size()) >= options_.max_live_keys_per_writer) {
      return Delete();
    }
    int r = std::uniform_int_distribution<int>(0, 99)(rng_);
    if (r < 30) return SetNew();
    if (r < 45) return Add();
    if (r < 55) return MultiSet();
    if (r < 65) return Append();
    if (r < 85) return Delete();
    return CompareSet();
  }

  std::string NewKey() {
    return absl::StrCat(kPrefix, "w", id_, "/t", trial_, "/", seq_++);
  }
  std::string SmallValue(absl::string_view key, uint64_t gen) {
    return ValueFor(key, gen,
                    std::uniform_int_distribution<size_t>(0, 200)(rng_));
  }

  // The call failed: unless cohortd is being killed, that is a finding.
  bool Failed(absl::string_view what, absl::string_view key,
              const grpc::Status& status) {
    ++counts_.in_flight;
    if (!killing_->load()) {
      findings_.Anomaly(absl::StrCat("trial ", trial_, ": ", what, " ", key,
                                     " failed before the kill: code ",
                                     status.error_code(), ": ",
                                     status.error_message()));
    }
    return false;
  }

  // Revisions of one writer's acknowledged calls increase: each call starts
  // after the previous reply, so a change it makes comes later.
  void Revision(absl::string_view what, int64_t revision, bool changed) {
    if (changed ? revision <= last_revision_ : revision < last_revision_) {
      findings_.Anomaly(absl::StrCat("trial ", trial_, ": ", what,
                                     " acknowledged at revision ", revision,
                                     " after one at ", last_revision_));
    }
    last_revision_ = std::max(last_revision_, revision);
  }

  void Acked(const std::string& key, State state, std::string what) {
    KeyModel& m = keys_[key];
    m.acked = std::move(state);
    m.maybe.clear();
    m.last = absl::StrCat(what, " in trial ", trial_);
  }

  bool SetNew() {
    v1::SetRequest req;
    req.set_key(NewKey());
    req.set_value(SmallValue(req.key(), 0));
    v1::SetResponse resp;
    keys_[req.key()].small = true;
    if (grpc::Status s = Call(&v1::Store::Stub::Set, req, &resp); !s.ok()) {
      keys_[req.key()].maybe = {req.value()};
      return Failed("set", req.key(), s);
    }
    Acked(req.key(), req.value(), "set");
    live_.push_back(req.key());
    Revision("set", resp.revision(), true);
    ++counts_.sets;
    return true;
  }

  bool BigSet() {
    v1::SetRequest req;
    req.set_key(absl::StrCat(
        kPrefix, "w", id_, "/big/",
        std::uniform_int_distribution<int>(0, kBigSlots - 1)(rng_)));
    req.set_value(ValueFor(
        req.key(), seq_++,
        std::uniform_int_distribution<size_t>(
            options_.min_big_value_bytes, options_.max_big_value_bytes)(rng_)));
    v1::SetResponse resp;
    if (grpc::Status s = Call(&v1::Store::Stub::Set, req, &resp); !s.ok()) {
      keys_[req.key()].maybe = {req.value()};
      return Failed("big set", req.key(), s);
    }
    Acked(req.key(), req.value(), "big set");
    Revision("big set", resp.revision(), true);
    ++counts_.big_sets;
    return true;
  }

  bool Add() {
    const int c = std::uniform_int_distribution<int>(0, kCounters - 1)(rng_);
    v1::AddRequest req;
    req.set_key(CounterKey(c));
    req.set_delta(std::uniform_int_distribution<int64_t>(1, 1000)(rng_));
    v1::AddResponse resp;
    if (grpc::Status s = Call(&v1::Store::Stub::Add, req, &resp); !s.ok()) {
      in_flight_delta_[c] = req.delta();
      return Failed("add", req.key(), s);
    }
    acked_delta_[c] += req.delta();
    // Other writers only add too, so the sum is at least our share.
    if (resp.value() < base_[c] + acked_delta_[c]) {
      findings_.Lost(absl::StrCat(
          "trial ", trial_, ": add to ", req.key(), " returned ", resp.value(),
          ", below its verified ", base_[c],
          " plus this writer's acknowledged deltas ", acked_delta_[c]));
    }
    Revision("add", resp.revision(), true);
    ++counts_.adds;
    counts_.add_delta_sum += req.delta();
    return true;
  }

  bool MultiSet() {
    const int n = std::uniform_int_distribution<int>(2, 6)(rng_);
    v1::MultiSetRequest req;
    std::set<std::string> chosen;
    for (int i = 0; i < n; ++i) {
      std::string key;
      if (!live_.empty() && rng_() % 2 == 0) {
        key = live_[rng_() % live_.size()];
        if (!chosen.insert(key).second) continue;
      } else {
        key = NewKey();
        chosen.insert(key);
      }
      req.add_keys(key);
      req.add_values(SmallValue(key, seq_++));
    }
    v1::MultiSetResponse resp;
    for (const std::string& key : req.keys()) keys_[key].small = true;
    if (grpc::Status s = Call(&v1::Store::Stub::MultiSet, req, &resp);
        !s.ok()) {
      for (int i = 0; i < req.keys_size(); ++i) {
        keys_[req.keys(i)].maybe = {req.values(i)};
        in_flight_multiset_.emplace_back(req.keys(i), req.values(i));
      }
      return Failed("multi_set", req.keys(0), s);
    }
    for (int i = 0; i < req.keys_size(); ++i) {
      if (!keys_[req.keys(i)].acked.has_value()) live_.push_back(req.keys(i));
      Acked(req.keys(i), req.values(i), "multi_set");
    }
    Revision("multi_set", resp.revision(), true);
    ++counts_.multisets;
    counts_.multiset_keys += req.keys_size();
    return true;
  }

  bool Append() {
    const std::string key = absl::StrCat(kPrefix, "w", id_, "/log");
    KeyModel& m = keys_[key];
    if (m.acked.has_value() && m.acked->size() > kMaxLogBytes) {
      return DeleteKey(key);
    }
    v1::AppendRequest req;
    req.set_key(key);
    req.set_value(absl::StrCat(trial_, ".", seq_++, ";"));
    const std::string after = m.acked.value_or("") + req.value();
    v1::AppendResponse resp;
    if (grpc::Status s = Call(&v1::Store::Stub::Append, req, &resp); !s.ok()) {
      m.maybe = {after};
      return Failed("append", key, s);
    }
    Acked(key, after, "append");
    Revision("append", resp.revision(), true);
    ++counts_.appends;
    return true;
  }

  bool Delete() {
    if (live_.empty()) return SetNew();
    const size_t at = rng_() % live_.size();
    std::string key = std::move(live_[at]);
    live_[at] = std::move(live_.back());
    live_.pop_back();
    return DeleteKey(key);
  }

  // Deletes `key`, which the acknowledged writes left present.
  bool DeleteKey(const std::string& key) {
    v1::DeleteRequest req;
    req.set_key(key);
    v1::DeleteResponse resp;
    if (grpc::Status s = Call(&v1::Store::Stub::Delete, req, &resp); !s.ok()) {
      keys_[key].maybe = {std::nullopt};
      return Failed("delete", key, s);
    }
    if (!resp.deleted()) {
      findings_.Lost(absl::StrCat("trial ", trial_, ": delete of ", key,
                                  " found nothing, but ", keys_[key].last,
                                  " left it ", Describe(keys_[key].acked)));
    }
    Acked(key, std::nullopt, "delete");
    Revision("delete", resp.revision(), resp.deleted());
    ++counts_.deletes;
    return true;
  }

  // Mostly a swap from the acknowledged value; sometimes a stale `expected`
  // that must write nothing.
  bool CompareSet() {
    const std::string key = absl::StrCat(kPrefix, "w", id_, "/cas");
    KeyModel& m = keys_[key];
    v1::CompareSetRequest req;
    req.set_key(key);
    req.set_desired(absl::StrCat("c", trial_, ".", seq_++));
    const bool stale = rng_() % 5 == 0;
    req.set_expected(stale ? absl::StrCat("stale", seq_++)
                           : m.acked.value_or(""));
    const bool swap = !stale;
    const std::string value =
        swap ? req.desired() : m.acked.value_or(req.expected());
    v1::CompareSetResponse resp;
    if (grpc::Status s = Call(&v1::Store::Stub::CompareSet, req, &resp);
        !s.ok()) {
      if (swap) m.maybe = {req.desired()};
      return Failed("compare_set", key, s);
    }
    if (resp.swapped() != swap || resp.value() != value) {
      std::string what = absl::StrCat(
          "trial ", trial_, ": compare_set of ", key, " expecting \"",
          absl::CEscape(req.expected()), "\" returned \"",
          absl::CEscape(resp.value()), "\" swapped=", resp.swapped(), ", but ",
          m.last, " left it ", Describe(m.acked));
      if (swap && !resp.swapped()) {
        findings_.Lost(std::move(what));
      } else {
        findings_.Anomaly(std::move(what));
      }
    }
    if (resp.swapped()) Acked(key, req.desired(), "compare_set");
    Revision("compare_set", resp.revision(), resp.swapped());
    ++counts_.compare_sets;
    counts_.compare_sets_swapped += resp.swapped();
    return true;
  }

  const int id_;
  const KillTrialOptions& options_;
  std::mt19937_64 rng_;
  uint64_t seq_ = 0;
  std::map<std::string, KeyModel> keys_;
  std::vector<std::string> live_;  // Small keys the model holds present.

  // Per trial.
  std::unique_ptr<v1::Store::Stub> stub_;
  int trial_ = 0;
  const int64_t* base_ = nullptr;
  const std::atomic<bool>* killing_ = nullptr;
  int64_t last_revision_ = 0;
  int64_t acked_delta_[kCounters] = {};
  int64_t in_flight_delta_[kCounters] = {};
  std::vector<std::pair<std::string, std::string>> in_flight_multiset_;

  Counts counts_;
  Findings findings_;
};

absl::StatusOr<CohortdProcess> Restart(const KillTrialOptions& options,
                                       bool sync_writes, int port,
                                       int* retries) {
  std::vector<std::string> args = {"--data_dir=" + options.data_dir};
  if (sync_writes) args.push_back("--sync_writes");
  args.insert(args.end(), options.cohortd_args.begin(),
              options.cohortd_args.end());
  // The killed cohortd's port can take a moment to be free again.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  for (;;) {
    absl::StatusOr<CohortdProcess> server = CohortdProcess::Start(args, port);
    if (server.ok() || absl::Now() > give_up) return server;
    ++*retries;
    absl::SleepFor(absl::Milliseconds(100));
  }
}

// Reads the whole store back and checks it against the writers' models and
// the counters' bounds; then makes the models what the store holds.
class Checker {
 public:
  Checker(std::vector<std::unique_ptr<Writer>>* writers,
          KillTrialReport* report, Findings* findings)
      : writers_(*writers), report_(*report), findings_(*findings) {}

  const int64_t* counter_base() const { return base_; }
  int64_t revision() const { return revision_; }

  absl::Status Verify(const std::string& address, int trial) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    stub_ = v1::Store::NewStub(grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), args));
    trial_ = trial;
    absl::Status status = VerifyAll();
    stub_.reset();
    return status;
  }

 private:
  template <typename Request, typename Response>
  absl::Status Call(absl::string_view what,
                    grpc::Status (v1::Store::Stub::*method)(
                        grpc::ClientContext*, const Request&, Response*),
                    const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kRpcDeadline));
    context.set_wait_for_ready(true);
    grpc::Status s = (stub_.get()->*method)(&context, request, response);
    return base::FromGrpcStatus(
        s, absl::StrCat("verifying trial ", trial_, ": ", what));
  }

  absl::Status VerifyAll() {
    std::set<std::string> listed;
    v1::ListKeysRequest list;
    list.set_prefix(kPrefix);
    do {
      v1::ListKeysResponse page;
      if (absl::Status s =
              Call("list_keys", &v1::Store::Stub::ListKeys, list, &page);
          !s.ok()) {
        return s;
      }
      for (std::string& k : *page.mutable_keys()) listed.insert(std::move(k));
      list.set_page_token(page.next_page_token());
    } while (!list.page_token().empty());

    v1::NumKeysResponse num;
    if (absl::Status s = Call("num_keys", &v1::Store::Stub::NumKeys,
                              v1::NumKeysRequest(), &num);
        !s.ok()) {
      return s;
    }
    if (trial_ < 0 && num.num_keys() != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cohortd's folder already holds ", num.num_keys(),
          " keys: the trials need a folder of their own, empty at first"));
    }
    if (num.num_keys() != static_cast<int64_t>(listed.size())) {
      findings_.Anomaly(absl::StrCat("after trial ", trial_, ": num_keys says ",
                                     num.num_keys(), ", list_keys listed ",
                                     listed.size()));
    }
    int64_t acked_revision = revision_;
    for (const auto& w : writers_) {
      acked_revision = std::max(acked_revision, w->max_revision());
    }
    if (num.revision() < acked_revision) {
      findings_.Lost(absl::StrCat("after trial ", trial_,
                                  ": cohortd restarted at revision ",
                                  num.revision(), ", below ", acked_revision,
                                  " (acknowledged, or seen before)"));
    }
    revision_ = num.revision();

    absl::StatusOr<std::map<std::string, std::string>> values = Read(listed);
    if (!values.ok()) return values.status();
    if (absl::Status s = CheckAbsent(listed); !s.ok()) return s;

    for (const auto& w : writers_) CheckWriter(*w, *values, &listed);
    CheckCounters(*values, &listed);
    for (const std::string& key : listed) {
      findings_.Anomaly(absl::StrCat("after trial ", trial_, ": ", key,
                                     " exists, but no write left it there"));
    }
    for (const auto& w : writers_) w->Rebuild();
    return absl::OkStatus();
  }

  // The values of every listed key, read with MultiGet in batches. Also
  // checks that Check agrees every listed key exists.
  absl::StatusOr<std::map<std::string, std::string>> Read(
      const std::set<std::string>& listed) {
    std::map<std::string, size_t> expected_size;
    for (const auto& w : writers_) {
      for (const auto& [key, m] : w->keys()) {
        size_t size = m.acked.has_value() ? m.acked->size() : 0;
        for (const State& s : m.maybe) {
          if (s.has_value()) size = std::max(size, s->size());
        }
        expected_size[key] = size;
      }
    }
    std::map<std::string, std::string> values;
    v1::MultiGetRequest req;
    req.set_timeout_ms(10000);
    size_t bytes = 0;
    auto flush = [&]() -> absl::Status {
      if (req.keys().empty()) return absl::OkStatus();
      v1::MultiGetResponse resp;
      if (absl::Status s =
              Call("multi_get", &v1::Store::Stub::MultiGet, req, &resp);
          !s.ok()) {
        return s;
      }
      if (resp.values_size() != req.keys_size()) {
        return absl::InternalError(
            absl::StrCat("multi_get of ", req.keys_size(), " keys returned ",
                         resp.values_size(), " values"));
      }
      v1::CheckRequest check;
      *check.mutable_keys() = req.keys();
      v1::CheckResponse exist;
      if (absl::Status s =
              Call("check", &v1::Store::Stub::Check, check, &exist);
          !s.ok()) {
        return s;
      }
      if (!exist.all_exist()) {
        findings_.Anomaly(absl::StrCat(
            "after trial ", trial_,
            ": check of listed keys says not all exist, from ", req.keys(0)));
      }
      for (int i = 0; i < req.keys_size(); ++i) {
        values[req.keys(i)] = std::move(*resp.mutable_values(i));
      }
      req.clear_keys();
      bytes = 0;
      return absl::OkStatus();
    };
    for (const std::string& key : listed) {
      auto it = expected_size.find(key);
      bytes += it == expected_size.end() ? 1024 : it->second;
      req.add_keys(key);
      if (bytes >= kReadBatchBytes || req.keys_size() >= kReadBatchKeys) {
        if (absl::Status s = flush(); !s.ok()) return s;
      }
    }
    if (absl::Status s = flush(); !s.ok()) return s;
    return values;
  }

  // Check agrees that every modelled key missing from the listing is absent.
  absl::Status CheckAbsent(const std::set<std::string>& listed) {
    for (const auto& w : writers_) {
      for (const auto& [key, m] : w->keys()) {
        if (listed.count(key)) continue;
        v1::CheckRequest req;
        req.add_keys(key);
        v1::CheckResponse resp;
        if (absl::Status s = Call("check", &v1::Store::Stub::Check, req, &resp);
            !s.ok()) {
          return s;
        }
        if (resp.all_exist()) {
          findings_.Anomaly(absl::StrCat("after trial ", trial_, ": ", key,
                                         " is not listed, but check finds it"));
        }
      }
    }
    return absl::OkStatus();
  }

  void CheckWriter(Writer& w, const std::map<std::string, std::string>& values,
                   std::set<std::string>* listed) {
    bool applied = false;
    for (auto it = w.keys().begin(); it != w.keys().end();) {
      const std::string& key = it->first;
      KeyModel& m = it->second;
      State actual;
      if (auto v = values.find(key); v != values.end()) actual = v->second;
      listed->erase(key);
      ++report_.keys_verified;
      if (actual != m.acked) {
        if (std::find(m.maybe.begin(), m.maybe.end(), actual) !=
            m.maybe.end()) {
          applied = true;
        } else {
          findings_.Lost(absl::StrCat("after trial ", trial_, ": ", key, ": ",
                                      m.last, " left it ", Describe(m.acked),
                                      "; the store has ", Describe(actual)));
        }
      }
      if (!actual.has_value()) {
        it = w.keys().erase(it);
        continue;
      }
      m.acked = std::move(actual);
      m.maybe.clear();
      m.last = absl::StrCat("verified after trial ", trial_);
      ++it;
    }
    report_.in_flight_applied += applied;
    const auto& multiset = w.in_flight_multiset();
    size_t done = 0;
    for (const auto& [key, value] : multiset) {
      auto v = values.find(key);
      done += v != values.end() && v->second == value;
    }
    if (done != 0 && done != multiset.size()) {
      findings_.Anomaly(absl::StrCat(
          "after trial ", trial_, ": a multi_set in flight at the kill left ",
          done, " of its ", multiset.size(), " keys written, from ",
          multiset[0].first));
    }
  }

  void CheckCounters(const std::map<std::string, std::string>& values,
                     std::set<std::string>* listed) {
    for (int c = 0; c < kCounters; ++c) {
      const std::string key = CounterKey(c);
      ++report_.keys_verified;
      int64_t low = base_[c], in_flight = 0;
      for (const auto& w : writers_) {
        low += w->acked_delta(c);
        in_flight += w->in_flight_delta(c);
      }
      int64_t actual = 0;
      if (auto v = values.find(key); v != values.end()) {
        if (!absl::SimpleAtoi(v->second, &actual)) {
          findings_.Anomaly(absl::StrCat("after trial ", trial_, ": counter ",
                                         key, " holds \"",
                                         absl::CEscape(v->second), "\""));
        }
      }
      listed->erase(key);
      if (actual < low) {
        findings_.Lost(absl::StrCat("after trial ", trial_, ": counter ", key,
                                    " is ", actual, ", below the ", low,
                                    " its acknowledged adds made"));
      } else if (actual > low + in_flight) {
        findings_.Anomaly(absl::StrCat("after trial ", trial_, ": counter ",
                                       key, " is ", actual, ", above the ", low,
                                       " acknowledged plus ", in_flight,
                                       " in flight"));
      }
      base_[c] = actual;
    }
  }

  std::vector<std::unique_ptr<Writer>>& writers_;
  KillTrialReport& report_;
  Findings& findings_;
  std::unique_ptr<v1::Store::Stub> stub_;
  int trial_ = 0;
  int64_t base_[kCounters] = {};
  int64_t revision_ = 0;
};

void Merge(Writer& w, KillTrialReport* report, Findings* findings) {
  Counts& c = w.counts();
  report->sets += c.sets;
  report->big_sets += c.big_sets;
  report->multisets += c.multisets;
  report->multiset_keys += c.multiset_keys;
  report->appends += c.appends;
  report->adds += c.adds;
  report->add_delta_sum += c.add_delta_sum;
  report->deletes += c.deletes;
  report->compare_sets += c.compare_sets;
  report->compare_sets_swapped += c.compare_sets_swapped;
  report->in_flight += c.in_flight;
  c = Counts();
  Findings& f = w.findings();
  findings->lost += f.lost;
  findings->anomalies += f.anomalies;
  for (std::string& s : f.failures) findings->Note(std::move(s));
  f = Findings();
}

void RunAll(const KillTrialOptions& options, KillTrialReport* report,
            Findings* findings) {
  std::mt19937_64 rng(report->seed);
  std::vector<std::unique_ptr<Writer>> writers;
  for (int i = 0; i < options.writers; ++i) {
    writers.push_back(std::make_unique<Writer>(i, rng(), options));
  }
  Checker checker(&writers, report, findings);
  std::uniform_real_distribution<double> unit(0, 1);

  bool sync_writes = unit(rng) < options.sync_writes_fraction;
  absl::StatusOr<CohortdProcess> server =
      Restart(options, sync_writes, 0, &report->restart_retries);
  if (!server.ok()) {
    report->status = server.status();
    return;
  }
  const int port = server->port();
  // Trial -1: the store starts empty.
  report->status = checker.Verify(server->address(), -1);
  if (!report->status.ok()) return;

  for (int trial = 0; trial < options.trials; ++trial) {
    const absl::Duration delay =
        options.min_kill_delay +
        (options.max_kill_delay - options.min_kill_delay) * unit(rng);
    const bool trial_sync = sync_writes;
    std::atomic<bool> killing{false};
    std::atomic<int64_t> acked{0};
    std::atomic<int> writers_done{0};
    std::vector<std::thread> threads;
    for (auto& w : writers) {
      threads.emplace_back(&Writer::Run, w.get(), server->address(), trial,
                           checker.counter_base(), checker.revision(), &killing,
                           &acked, &writers_done);
    }
    if (options.kill_after_an_ack) {
      // No deadline needed: a writer's call either is acknowledged or fails
      // (at its own deadline at the latest), which ends that writer.
      while (acked == 0 && writers_done < static_cast<int>(writers.size())) {
        absl::SleepFor(absl::Milliseconds(1));
      }
    }
    absl::SleepFor(delay);
    killing = true;
    const int wait_status = server->Stop(SIGKILL);
    for (std::thread& t : threads) t.join();
    if (!WIFSIGNALED(wait_status) || WTERMSIG(wait_status) != SIGKILL) {
      findings->Anomaly(absl::StrCat(
          "trial ", trial, ": cohortd ended before the kill (wait status ",
          wait_status, "); its log:\n", server->Log()));
    }
    report->sync_trials += trial_sync;
    ++report->trials;

    sync_writes = unit(rng) < options.sync_writes_fraction;
    server = Restart(options, sync_writes, port, &report->restart_retries);
    if (!server.ok()) {
      report->status = absl::Status(
          server.status().code(),
          absl::StrCat("cohortd did not restart after the kill of trial ",
                       trial, ": ", server.status().message()));
      for (auto& w : writers) Merge(*w, report, findings);
      return;
    }
    report->status = checker.Verify(server->address(), trial);
    for (auto& w : writers) Merge(*w, report, findings);
    if (!report->status.ok()) return;
    if (options.log) {
      options.log(absl::StrFormat(
          "trial %d: killed after %.0f ms%s; %d writes acknowledged so far, "
          "%d lost, %d anomalies",
          trial, absl::ToDoubleMilliseconds(delay),
          trial_sync ? " (--sync_writes)" : "", report->acked(), findings->lost,
          findings->anomalies));
    }
  }

  // After the crash loop, a clean stop still works.
  const int wait_status = server->Stop(SIGTERM);
  if (!WIFEXITED(wait_status) || WEXITSTATUS(wait_status) != 0) {
    findings->Anomaly(absl::StrCat("SIGTERM after the trials: wait status ",
                                   wait_status, "; its log:\n", server->Log()));
  }
}

}  // namespace

std::string KillTrialReport::Summary() const {
  return absl::StrFormat(
      "kill trials: %d (%d with --sync_writes), seed %d; acknowledged writes "
      "%d: sets %d, big sets %d, multi_sets %d (%d keys), appends %d, adds %d "
      "(sum %d), deletes %d, compare_sets %d (%d swapped); in flight at the "
      "kill %d (%d keyed calls found applied); keys verified %d; lost %d; "
      "anomalies %d; restarts waiting for the port %d; data folder %d .sst, "
      "%d .blob, %.1f MiB; wall %.1f s",
      trials, sync_trials, seed, acked(), sets, big_sets, multisets,
      multiset_keys, appends, adds, add_delta_sum, deletes, compare_sets,
      compare_sets_swapped, in_flight, in_flight_applied, keys_verified, lost,
      anomalies, restart_retries, sst_files, blob_files, data_bytes / 1048576.0,
      absl::ToDoubleSeconds(wall));
}

KillTrialReport RunKillTrials(const KillTrialOptions& options) {
  const absl::Time start = absl::Now();
  KillTrialReport report;
  report.seed = options.seed != 0 ? options.seed : std::random_device{}();
  Findings findings;
  RunAll(options, &report, &findings);
  report.lost = findings.lost;
  report.anomalies = findings.anomalies;
  report.failures = std::move(findings.failures);
  std::error_code error;
  for (const auto& entry :
       std::filesystem::recursive_directory_iterator(options.data_dir, error)) {
    if (!entry.is_regular_file(error)) continue;
    const std::string ext = entry.path().extension().string();
    report.sst_files += ext == ".sst";
    report.blob_files += ext == ".blob";
    const uintmax_t size = entry.file_size(error);
    if (!error) report.data_bytes += size;
  }
  report.wall = absl::Now() - start;
  return report;
}

}  // namespace cohort::testing

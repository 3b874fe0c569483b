// StatusPage without a socket: the JSON of runs, members (alive, failed,
// erring, left), a barrier's missing participants and a diagnosis from
// flight dumps written into the store; what each token may see; and the
// answer to every kind of bad request.
#include "server/status/status_page.h"

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "proto/flight/flight_keys.h"
#include "store/kv_engine.h"

namespace cohort::server {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

constexpr char kAdmin[] = "admin-token-0123456789";
constexpr char kJob1[] = "job1-token-0123456789";
constexpr char kOther[] = "other-token-0123456789";
constexpr int64_t kLongMs = 10 * 60 * 1000;

// The JSON parsed (a parse failure fails the test).
Struct Parse(const std::string& json) {
  Struct out;
  auto status = google::protobuf::util::JsonStringToMessage(json, &out);
  EXPECT_TRUE(status.ok()) << status.ToString() << "\n" << json;
  return out;
}

const Value& Field(const Struct& s, const std::string& name) {
  static const Value* missing = new Value();
  auto it = s.fields().find(name);
  return it == s.fields().end() ? *missing : it->second;
}

// The element of `list` whose `key` is `value`.
const Struct& Find(const Value& list, const std::string& key,
                   const std::string& value) {
  static const Struct* none = new Struct();
  for (const Value& v : list.list_value().values()) {
    if (Field(v.struct_value(), key).string_value() == value) {
      return v.struct_value();
    }
  }
  ADD_FAILURE() << "no element with " << key << " = " << value;
  return *none;
}

v1::FlightOp* AddOp(v1::FlightDump& dump, uint64_t seq, const char* state) {
  v1::FlightOp* op = dump.add_ops();
  op->set_seq(seq);
  op->set_op("AllReduce");
  op->set_dtype("f32");
  op->set_count(1024);
  op->set_root(-1);
  op->set_state(state);
  op->set_enqueued_us(1'700'000'000'000'000 + seq);
  op->set_started_us(1'700'000'000'000'000 + seq);
  if (std::string(state) == "done") op->set_ended_us(op->started_us() + 1);
  return op;
}

class StatusPageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rendezvous_ = std::make_shared<Rendezvous>(&store_);
    membership_ = std::make_shared<Membership>(&store_, absl::Milliseconds(10));
  }

  void StartAuth() {
    const std::string path =
        std::string(getenv("TEST_TMPDIR")) + "/status_tokens";
    std::ofstream(path) << kAdmin << " admin *\n"
                        << kJob1 << " r job1/\n"
                        << kOther << " rw other/\n";
    auto auth = Authenticator::Start({.tokens_file = path, .store = &store_});
    ASSERT_TRUE(auth.ok()) << auth.status();
    auth_ = std::move(*auth);
  }

  void Track() {
    page_.Track({.store = &store_,
                 .auth = auth_.get(),
                 .rendezvous = rendezvous_,
                 .membership = membership_});
  }

  void JoinRun(const std::string& run, const std::string& node, int nodes) {
    v1::JoinRequest req;
    req.set_run_id(run);
    req.set_node_id(node);
    req.set_address(node + ".example:29500");
    req.set_local_world_size(2);
    req.set_min_nodes(nodes);
    req.set_max_nodes(nodes);
    req.set_join_timeout_ms(kLongMs);
    rendezvous_->Join(req, [](absl::StatusOr<v1::JoinResponse>) {});
  }

  int64_t JoinGroup(const std::string& group, const std::string& name, int rank,
                    int64_t interval_ms = kLongMs) {
    v1::JoinGroupRequest req;
    req.set_group(group);
    req.set_name(name);
    req.set_rank(rank);
    req.set_host("host-" + name);
    req.set_heartbeat_interval_ms(interval_ms);
    req.set_missed_heartbeats(3);
    absl::StatusOr<v1::JoinGroupResponse> r = membership_->Join(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->incarnation() : 0;
  }

  void Arrive(const std::string& name, int64_t incarnation) {
    v1::BarrierRequest req;
    req.set_group("job1");
    req.set_barrier_id("init");
    req.set_name(name);
    req.set_incarnation(incarnation);
    req.set_timeout_ms(kLongMs);
    for (const char* p : {"a", "b", "c"}) req.add_participants(p);
    membership_->Barrier(req, [](absl::StatusOr<int64_t>) {});
  }

  // Run job1 (a complete round of two nodes) and its group: a and b at
  // barrier "init", c missing from it, d failed; flight dumps of round 0
  // where rank 1 never entered #2, and one that is not a dump. Run job2
  // still collecting; group other with one member.
  void StartJob() {
    JoinRun("job1", "node-a", 2);
    JoinRun("job1", "node-b", 2);
    JoinRun("job2", "node-x", 2);
    const int64_t a = JoinGroup("job1", "a", 0);
    const int64_t b = JoinGroup("job1", "b", 1);
    JoinGroup("job1", "c", 2);
    JoinGroup("job1", "d", 3, 10);
    JoinGroup("other", "o", 0);
    Arrive("a", a);
    Arrive("b", b);
    for (int rank : {0, 1}) {
      v1::FlightDump dump;
      dump.set_rank(rank);
      dump.set_world_size(2);
      dump.set_group("0");
      dump.set_run("job1");
      dump.set_round(0);
      dump.set_node(rank == 0 ? "a" : "b");
      AddOp(dump, 1, "done");
      if (rank == 0) AddOp(dump, 2, "running");
      ASSERT_TRUE(store_
                      .Set(flight::FlightDumpKey("job1", 0, "0", rank),
                           flight::EncodeFlightDump(dump))
                      .ok());
    }
    ASSERT_TRUE(
        store_.Set(flight::FlightDumpKey("job1", 0, "0", 2), "{oops").ok());
    ASSERT_TRUE(store_.Set("runs/job1/other", "x").ok());
    ASSERT_TRUE(store_.Set("/cohortrun/job1/k", "x").ok());
    ASSERT_TRUE(store_.Set("elsewhere", "x").ok());
    // d's lease is 30 ms: wait until the sweep has failed it.
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (membership_->Snapshot("job1", 10)->alive != 3 &&
           absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  HttpResponse Get(const std::string& query, const std::string& token = "",
                   const std::string& authorization = "") {
    HttpRequest request{.method = "GET", .path = "/api/status", .query = query};
    if (!token.empty()) {
      request.headers.emplace_back("Authorization",
                                   std::string("Bearer ") + token);
    } else if (!authorization.empty()) {
      request.headers.emplace_back("Authorization", authorization);
    }
    return page_.Api(request);
  }

  // The error message of an error response.
  std::string Message(const HttpResponse& r) {
    return Field(Field(Parse(r.body), "error").struct_value(), "message")
        .string_value();
  }

  store::KvStore store_{store::NewMemoryEngine()};
  std::unique_ptr<Authenticator> auth_;
  std::shared_ptr<Rendezvous> rendezvous_;
  std::shared_ptr<Membership> membership_;
  StatusPage page_;
};

TEST_F(StatusPageTest, ShowsRunsMembersBarriersAndDiagnosis) {
  Track();
  StartJob();
  HttpResponse r = Get("");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.content_type, "application/json");
  const Struct s = Parse(r.body);
  EXPECT_EQ(Field(s, "revision").number_value(), store_.revision());
  EXPECT_EQ(Field(s, "keys").number_value(), store_.stats().keys);
  EXPECT_EQ(Field(s, "viewer").string_value(), "auth off");
  EXPECT_TRUE(Field(s, "coordinating").bool_value());

  const Struct& job1 = Find(Field(s, "runs"), "run", "job1");
  EXPECT_EQ(Field(job1, "phase").string_value(), "COMPLETE");
  EXPECT_EQ(Field(job1, "round").number_value(), 0);
  EXPECT_EQ(Field(job1, "num_nodes").number_value(), 2);
  const Struct& node_b = Find(Field(job1, "nodes"), "node_id", "node-b");
  EXPECT_EQ(Field(node_b, "node_rank").number_value(), 1);
  EXPECT_EQ(Field(node_b, "first_global_rank").number_value(), 2);
  EXPECT_EQ(Field(node_b, "address").string_value(), "node-b.example:29500");
  // Three dumps and runs/job1/other under runs/job1/, one under
  // /cohortrun/job1/.
  EXPECT_EQ(Field(job1, "keys").number_value(), 5);
  const Struct& diagnosis = Field(job1, "diagnosis").struct_value();
  EXPECT_EQ(Field(diagnosis, "round").number_value(), 0);
  ASSERT_EQ(Field(diagnosis, "errors").list_value().values_size(), 1);
  EXPECT_TRUE(absl::StrContains(
      Field(diagnosis, "errors").list_value().values(0).string_value(),
      "is not a FlightDump"));
  const Struct& group0 = Find(Field(diagnosis, "groups"), "group", "0");
  EXPECT_EQ(Field(group0, "ranks_dumped").number_value(), 2);
  const Value& findings = Field(group0, "findings");
  ASSERT_GE(findings.list_value().values_size(), 1);
  const Struct& hang = findings.list_value().values(0).struct_value();
  EXPECT_EQ(Field(hang, "kind").string_value(), "hang");
  EXPECT_EQ(Field(hang, "ranks").list_value().values(0).number_value(), 1);
  EXPECT_TRUE(absl::StrContains(Field(hang, "sentence").string_value(),
                                "rank 1 last completed #1 and has not "
                                "entered #2"))
      << Field(hang, "sentence").string_value();

  const Struct& job2 = Find(Field(s, "runs"), "run", "job2");
  EXPECT_EQ(Field(job2, "phase").string_value(), "COLLECTING");
  EXPECT_EQ(Field(job2, "num_nodes").number_value(), 1);
  EXPECT_EQ(Field(job2, "diagnosis").kind_case(), Value::kNullValue);

  const Struct& group = Find(Field(s, "groups"), "group", "job1");
  EXPECT_EQ(Field(group, "members_total").number_value(), 4);
  EXPECT_EQ(Field(group, "members_alive").number_value(), 3);
  const Struct& a = Find(Field(group, "members"), "name", "a");
  EXPECT_EQ(Field(a, "state").string_value(), "alive");
  EXPECT_EQ(Field(a, "rank").number_value(), 0);
  EXPECT_EQ(Field(a, "host").string_value(), "host-a");
  EXPECT_GT(Field(a, "incarnation").number_value(), 0);
  EXPECT_GT(Field(a, "lease_left_ms").number_value(), 0);
  const Struct& d = Find(Field(group, "members"), "name", "d");
  EXPECT_EQ(Field(d, "state").string_value(), "failed");
  EXPECT_TRUE(absl::StrContains(Field(d, "message").string_value(),
                                "no heartbeat for 30ms"));
  EXPECT_EQ(Field(d, "lease_left_ms").number_value(), 0);
  const Struct& init = Find(Field(group, "barriers"), "barrier", "init");
  EXPECT_EQ(Field(init, "participants").number_value(), 3);
  EXPECT_EQ(Field(init, "arrived").number_value(), 2);
  EXPECT_EQ(Field(init, "timeout_ms").number_value(), kLongMs);
  const Value& missing = Field(init, "missing");
  ASSERT_EQ(missing.list_value().values_size(), 1);
  const Struct& c = missing.list_value().values(0).struct_value();
  EXPECT_EQ(Field(c, "name").string_value(), "c");
  EXPECT_EQ(Field(c, "rank").number_value(), 2);
  EXPECT_EQ(Field(c, "host").string_value(), "host-c");
  Find(Field(s, "groups"), "group", "other");

  // One run: that run and its group only.
  r = Get("run=job1");
  ASSERT_EQ(r.status, 200) << r.body;
  const Struct one = Parse(r.body);
  EXPECT_EQ(Field(one, "runs").list_value().values_size(), 1);
  EXPECT_EQ(Field(one, "groups").list_value().values_size(), 1);
  EXPECT_EQ(Field(one, "keys").kind_case(), Value::KIND_NOT_SET);
}

TEST_F(StatusPageTest, ATokenSeesOnlyWhatItsPrefixCovers) {
  StartAuth();
  Track();
  StartJob();
  // The admin sees all.
  HttpResponse r = Get("", kAdmin);
  ASSERT_EQ(r.status, 200) << r.body;
  Struct s = Parse(r.body);
  EXPECT_EQ(Field(s, "runs").list_value().values_size(), 2);
  EXPECT_EQ(Field(s, "groups").list_value().values_size(), 2);
  EXPECT_EQ(Field(s, "keys").number_value(), store_.stats().keys);
  EXPECT_EQ(Field(s, "viewer").string_value(), "admin token for prefix '*'");
  // job1's token sees job1 alone, and no count of every key.
  r = Get("", kJob1);
  ASSERT_EQ(r.status, 200) << r.body;
  s = Parse(r.body);
  ASSERT_EQ(Field(s, "runs").list_value().values_size(), 1);
  Find(Field(s, "runs"), "run", "job1");
  ASSERT_EQ(Field(s, "groups").list_value().values_size(), 1);
  Find(Field(s, "groups"), "group", "job1");
  EXPECT_EQ(Field(s, "keys").kind_case(), Value::KIND_NOT_SET);
  EXPECT_EQ(Field(s, "viewer").string_value(), "r token for prefix 'job1/'");
  EXPECT_EQ(Get("run=job1", kJob1).status, 200);
  // Not another run, asked for by name.
  r = Get("run=job2", kJob1);
  EXPECT_EQ(r.status, 403);
  EXPECT_TRUE(absl::StrContains(Message(r), "outside it")) << r.body;
  // other's token sees the group "other" and no run.
  s = Parse(Get("", kOther).body);
  EXPECT_EQ(Field(s, "runs").list_value().values_size(), 0);
  EXPECT_EQ(Field(s, "groups").list_value().values_size(), 1);

  // No token, a malformed header, an unknown token: 401, naming no token.
  const uint64_t failures_before = auth_->stats().missing_token;
  r = Get("");
  EXPECT_EQ(r.status, 401);
  EXPECT_TRUE(absl::StrContains(Message(r), "Authorization: Bearer TOKEN"));
  ASSERT_EQ(r.headers.back().first, "WWW-Authenticate");
  EXPECT_EQ(auth_->stats().missing_token, failures_before + 1);
  r = Get("", "", "Basic dXNlcjpwYXNz");
  EXPECT_EQ(r.status, 401);
  EXPECT_TRUE(absl::StrContains(Message(r), "Bearer")) << r.body;
  r = Get("", "not-a-known-token-at-all");
  EXPECT_EQ(r.status, 401);
  EXPECT_FALSE(absl::StrContains(r.body, "not-a-known-token")) << r.body;
  // Auth comes first: a bad query from no one is still a 401.
  EXPECT_EQ(Get("run=").status, 401);
}

TEST_F(StatusPageTest, BadRequestsGetPreciseErrors) {
  EXPECT_EQ(Get("").status, 503);
  Track();
  StartJob();
  struct Case {
    std::string query;
    int status;
    std::string says;
  };
  for (const Case& c : std::vector<Case>{
           {"run=", 400, "1 to 512 bytes"},
           {"run=a%2Fb", 400, "with no '/'"},
           {"run=" + std::string(513, 'x'), 400, "1 to 512 bytes"},
           {"run=job1&run=job2", 400, "twice"},
           {"rnu=job1", 400, "unknown parameter 'rnu'"},
           {"run=%zz", 400, "percent-encoding"},
           {"run=nope", 404, "no run or group 'nope'"},
       }) {
    HttpResponse r = Get(c.query);
    EXPECT_EQ(r.status, c.status) << c.query << ": " << r.body;
    EXPECT_TRUE(absl::StrContains(Message(r), c.says))
        << c.query << ": " << r.body;
    EXPECT_EQ(r.content_type, "application/json");
  }
  // A group without a run is found by name too.
  EXPECT_EQ(Get("run=other").status, 200);
  // On a follower the runs are elsewhere, and it says so.
  page_.Track({.store = &store_});
  HttpResponse r = Get("run=job1");
  EXPECT_EQ(r.status, 404);
  EXPECT_TRUE(absl::StrContains(Message(r), "does not lead"));
  EXPECT_FALSE(Field(Parse(Get("").body), "coordinating").bool_value());
  page_.Untrack();
  EXPECT_EQ(Get("").status, 503);
}

TEST_F(StatusPageTest, ServesThePageItsFilesAndTheApi) {
  std::vector<std::string> paths;
  for (const HttpRoute& route : page_.Routes()) paths.push_back(route.path);
  EXPECT_EQ(paths, (std::vector<std::string>{"/", "/status.js", "/status.css",
                                             "/api/status"}));
  HttpResponse index = page_.Routes()[0].handler(HttpRequest{});
  EXPECT_EQ(index.status, 200);
  EXPECT_EQ(index.content_type, "text/html; charset=utf-8");
  EXPECT_TRUE(absl::StartsWith(index.body, "<!doctype html>"));
  EXPECT_TRUE(absl::StrContains(index.body, "<script src=\"/status.js\""));
  bool policy = false;
  for (const auto& [name, value] : index.headers) {
    if (name == "Content-Security-Policy") {
      policy = absl::StrContains(value, "connect-src 'self'");
    }
  }
  EXPECT_TRUE(policy);
  HttpResponse js = page_.Routes()[1].handler(HttpRequest{});
  EXPECT_EQ(js.content_type, "text/javascript; charset=utf-8");
  EXPECT_TRUE(absl::StrContains(js.body, "/api/status"));
  // Nothing the page loads comes from elsewhere.
  for (const HttpRoute& route : page_.Routes()) {
    const std::string body = route.handler(HttpRequest{}).body;
    EXPECT_FALSE(absl::StrContains(body, "http://")) << route.path;
    EXPECT_FALSE(absl::StrContains(body, "https://")) << route.path;
  }
}

}  // namespace
}  // namespace cohort::server

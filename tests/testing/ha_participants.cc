// ha_participants: the participants check of tests/robustness/etcd_ha_test.sh
// (participants mode). ListParticipants and GetParticipants are raw methods
// whose requests a follower passes to the leader as bytes (GenericStub);
// through the follower, every reply, error code and message must be
// exactly the leader's:
//   - a round of --nodes nodes joins through --join_addr;
//   - ListParticipants, all pages (page_size 2 and the default), and
//     GetParticipants of a few ranges, with and without `round`, list the
//     joined nodes in node-rank order;
//   - a range outside [0, num_nodes) is INVALID_ARGUMENT naming it, an
//     unknown run NOT_FOUND;
//   - after the next round, the old round (GetParticipants.round, and a
//     ListParticipants page token of it) is ABORTED.
// Prints what it checked and exits 1 on the first difference.
//
//   ha_participants --leader=IP:PORT --follower=IP:PORT --join_addr=IP:PORT
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/rendezvous_client.h"
#include "cohort/v1/coordination.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

ABSL_FLAG(std::string, leader, "", "the cohortd leader, IP:PORT");
ABSL_FLAG(std::string, follower, "", "a follower replica, IP:PORT");
ABSL_FLAG(std::string, join_addr, "", "where the nodes join (any replicas)");
ABSL_FLAG(std::string, run, "ha-peers", "the run id");
ABSL_FLAG(int, nodes, 5, "nodes in each round");

namespace {

namespace v1 = cohort::v1;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  std::exit(1);
}

void Check(bool ok, const std::string& what) {
  if (!ok) Fail(what);
}

// An answer: the status and, when OK, the reply's bytes.
struct Answer {
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
  std::string bytes;

  std::string ToString() const {
    return absl::StrCat("code ", code, " '", message, "' (", bytes.size(),
                        " bytes)");
  }
};

bool operator==(const Answer& a, const Answer& b) {
  return a.code == b.code && a.message == b.message && a.bytes == b.bytes;
}

// One replica, by a channel of its own (no failover to the other).
class Replica {
 public:
  explicit Replica(const std::string& address)
      : address_(address),
        stub_(v1::Rendezvous::NewStub(grpc::CreateChannel(
            address, grpc::InsecureChannelCredentials()))) {}

  const std::string& address() const { return address_; }

  template <typename Response>
  Answer List(const v1::ListParticipantsRequest& req, Response* resp) {
    return Call(&v1::Rendezvous::Stub::ListParticipants, req, resp);
  }
  template <typename Response>
  Answer Get(const v1::GetParticipantsRequest& req, Response* resp) {
    return Call(&v1::Rendezvous::Stub::GetParticipants, req, resp);
  }

 private:
  template <typename Method, typename Request, typename Response>
  Answer Call(Method method, const Request& req, Response* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    ctx.set_wait_for_ready(true);
    grpc::Status s = (stub_.get()->*method)(&ctx, req, resp);
    Answer a{s.error_code(), s.error_message(), ""};
    // The messages have no maps: equal replies serialize to equal bytes.
    if (s.ok()) a.bytes = resp->SerializeAsString();
    return a;
  }

  std::string address_;
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
};

// The same request to both replicas: the follower's answer must be the
// leader's. Returns it; `resp` is the leader's reply.
template <typename Request, typename Response>
Answer Same(Replica& leader, Replica& follower, const Request& req,
            Response* resp, const std::string& what) {
  Response from_follower;
  Answer f, l;
  if constexpr (std::is_same_v<Request, v1::ListParticipantsRequest>) {
    f = follower.List(req, &from_follower);
    l = leader.List(req, resp);
  } else {
    f = follower.Get(req, &from_follower);
    l = leader.Get(req, resp);
  }
  Check(f == l, absl::StrCat(what, ": the follower answered ", f.ToString(),
                             ", the leader ", l.ToString()));
  return l;
}

// Waits until the follower passes calls on: while it does not know the
// leader yet it answers UNAVAILABLE itself. An unknown run is NOT_FOUND.
void WaitForwarding(Replica& follower, const std::string& run) {
  v1::ListParticipantsRequest req;
  req.set_run_id(run);
  v1::ListParticipantsResponse resp;
  for (int i = 0;; ++i) {
    Answer a = follower.List(req, &resp);
    if (a.code != grpc::StatusCode::UNAVAILABLE) return;
    // A bound only so that a follower that never learns of the leader
    // fails the test instead of hanging it.
    Check(i < 600, "the follower never passed a call on: " + a.ToString());
    absl::SleepFor(absl::Milliseconds(100));
  }
}

// A round of `n` nodes (node-i, local_world_size 1 + i % 3) through
// `addr`: each node's view of it.
std::vector<cohort::RendezvousResult> JoinRound(const std::string& addr,
                                                const std::string& run, int n) {
  std::vector<absl::StatusOr<cohort::RendezvousResult>> results(
      n, absl::UnknownError("not joined"));
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      cohort::ConnectionOptions connection;
      connection.address = addr;
      auto client = cohort::RendezvousClient::Connect(connection);
      if (!client.ok()) {
        results[i] = client.status();
        return;
      }
      cohort::RendezvousOptions options;
      options.run_id = run;
      options.node_id = absl::StrCat("node-", i);
      options.address = absl::StrCat("10.0.0.", i, ":2950", i);
      options.local_world_size = 1 + i % 3;
      options.min_nodes = n;
      options.max_nodes = n;
      options.join_timeout = absl::Seconds(120);
      results[i] = (*client)->Join(options);
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<cohort::RendezvousResult> joined;
  for (int i = 0; i < n; ++i) {
    Check(
        results[i].ok(),
        absl::StrCat("node-", i, " joining: ", results[i].status().ToString()));
    joined.push_back(*results[i]);
  }
  return joined;
}

// `got` is exactly `peers` [start, end).
void CheckPeers(const google::protobuf::RepeatedPtrField<v1::Participant>& got,
                int from, const std::vector<cohort::RendezvousPeer>& peers,
                int start, int end, const std::string& what) {
  Check(got.size() >= from + end - start,
        absl::StrCat(what, ": ", got.size(), " participants"));
  for (int r = start; r < end; ++r) {
    const v1::Participant& p = got[from + r - start];
    const cohort::RendezvousPeer& want = peers[r];
    Check(p.node_rank() == want.node_rank && p.node_id() == want.node_id &&
              p.address() == want.address &&
              p.local_world_size() == want.local_world_size &&
              p.first_global_rank() == want.first_global_rank,
          absl::StrCat(what, ": node rank ", r, " is ", p.ShortDebugString(),
                       ", not ", want.node_id));
  }
}

v1::NodeRankRange Range(int start, int end) {
  v1::NodeRankRange r;
  r.set_start_node_rank(start);
  r.set_end_node_rank(end);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string run = absl::GetFlag(FLAGS_run);
  const int n = absl::GetFlag(FLAGS_nodes);
  Check(n >= 5, "--nodes must be at least 5");
  Replica leader(absl::GetFlag(FLAGS_leader));
  Replica follower(absl::GetFlag(FLAGS_follower));

  WaitForwarding(follower, run);
  {
    v1::ListParticipantsRequest req;
    req.set_run_id(run);
    v1::ListParticipantsResponse resp;
    Answer a = Same(leader, follower, req, &resp, "ListParticipants, no run");
    Check(a.code == grpc::StatusCode::NOT_FOUND, a.ToString());
    v1::GetParticipantsRequest get;
    get.set_run_id(run);
    *get.add_ranges() = Range(0, 1);
    v1::GetParticipantsResponse got;
    a = Same(leader, follower, get, &got, "GetParticipants, no run");
    Check(a.code == grpc::StatusCode::NOT_FOUND, a.ToString());
  }

  std::vector<cohort::RendezvousResult> first =
      JoinRound(absl::GetFlag(FLAGS_join_addr), run, n);
  const int64_t round = first[0].round;
  const std::vector<cohort::RendezvousPeer>& peers = first[0].peers;
  Check(static_cast<int>(peers.size()) == n,
        absl::StrCat("the join listed ", peers.size(), " peers"));
  std::printf("round %lld of %d nodes joined through %s\n",
              static_cast<long long>(round), n,
              absl::GetFlag(FLAGS_join_addr).c_str());

  // Every page, following the follower's own page tokens.
  std::string round_token;  // A page token of this round, for later.
  for (int page_size : {2, 0}) {
    v1::ListParticipantsRequest req;
    req.set_run_id(run);
    req.set_page_size(page_size);
    int listed = 0, pages = 0;
    do {
      v1::ListParticipantsResponse page;
      std::string what = absl::StrCat("ListParticipants page_size ", page_size,
                                      " page ", pages);
      Answer a = Same(leader, follower, req, &page, what);
      Check(a.code == grpc::StatusCode::OK, what + ": " + a.ToString());
      Check(page.round() == round && page.num_nodes() == n,
            what + ": " + page.ShortDebugString());
      const int end = std::min(n, listed + page.participants_size());
      CheckPeers(page.participants(), 0, peers, listed, end, what);
      listed = end;
      ++pages;
      if (round_token.empty()) round_token = page.next_page_token();
      req.set_page_token(page.next_page_token());
    } while (!req.page_token().empty() && pages <= n);
    Check(listed == n, absl::StrCat("page_size ", page_size, " listed ", listed,
                                    " of ", n, " nodes"));
    Check(pages == (page_size == 0 ? 1 : (n + page_size - 1) / page_size),
          absl::StrCat("page_size ", page_size, ": ", pages, " pages"));
  }
  Check(!round_token.empty(), "no page token for a page of 2");
  std::printf("ListParticipants: every page the leader's\n");

  // Ranges, with the round and without; a rank asked for twice comes twice.
  for (bool with_round : {true, false}) {
    struct Case {
      std::vector<std::pair<int, int>> ranges;
    };
    for (const Case& c :
         {Case{{{0, 1}}}, Case{{{n - 1, n}, {1, 3}, {2, 3}}}, Case{{{0, n}}}}) {
      v1::GetParticipantsRequest req;
      req.set_run_id(run);
      if (with_round) req.set_round(round);
      std::string what = "GetParticipants";
      for (auto [start, end] : c.ranges) {
        *req.add_ranges() = Range(start, end);
        absl::StrAppend(&what, " [", start, ", ", end, ")");
      }
      v1::GetParticipantsResponse resp;
      Answer a = Same(leader, follower, req, &resp, what);
      Check(a.code == grpc::StatusCode::OK, what + ": " + a.ToString());
      Check(resp.round() == round && resp.num_nodes() == n,
            what + ": " + resp.ShortDebugString());
      int from = 0;
      for (auto [start, end] : c.ranges) {
        CheckPeers(resp.participants(), from, peers, start, end, what);
        from += end - start;
      }
      Check(
          resp.participants_size() == from,
          absl::StrCat(what, ": ", resp.participants_size(), " participants"));
    }
  }
  std::printf("GetParticipants: every range the leader's\n");

  {
    v1::GetParticipantsRequest req;
    req.set_run_id(run);
    req.set_round(round);
    *req.add_ranges() = Range(0, 1);
    *req.add_ranges() = Range(n - 2, n + 1);
    v1::GetParticipantsResponse resp;
    Answer a = Same(leader, follower, req, &resp, "a range out of bounds");
    Check(a.code == grpc::StatusCode::INVALID_ARGUMENT &&
              absl::StrContains(a.message,
                                absl::StrCat("range 1 [", n - 2, ", ", n + 1,
                                             ") of run '", run, "'")) &&
              absl::StrContains(a.message, absl::StrCat(n, " node ranks")),
          "a range out of bounds: " + a.ToString());
    std::printf("out of range: %s\n", a.message.c_str());
  }

  // The next round: the old one is ABORTED, by its number and by a page
  // token of it.
  std::vector<cohort::RendezvousResult> second =
      JoinRound(absl::GetFlag(FLAGS_join_addr), run, n);
  Check(second[0].round > round,
        absl::StrCat("the second round is ", second[0].round));
  {
    v1::GetParticipantsRequest req;
    req.set_run_id(run);
    req.set_round(round);
    *req.add_ranges() = Range(0, n);
    v1::GetParticipantsResponse resp;
    Answer a = Same(leader, follower, req, &resp, "a stale round");
    Check(a.code == grpc::StatusCode::ABORTED &&
              absl::StrContains(a.message,
                                absl::StrCat("not round ", round, ": ")),
          "a stale round: " + a.ToString());
    std::printf("stale round: %s\n", a.message.c_str());

    req.set_round(second[0].round);
    a = Same(leader, follower, req, &resp, "the new round");
    Check(a.code == grpc::StatusCode::OK && resp.round() == second[0].round,
          "the new round: " + a.ToString());
    CheckPeers(resp.participants(), 0, second[0].peers, 0, n, "the new round");

    v1::ListParticipantsRequest list;
    list.set_run_id(run);
    list.set_page_size(2);
    list.set_page_token(round_token);
    v1::ListParticipantsResponse page;
    a = Same(leader, follower, list, &page, "a page token of a stale round");
    Check(a.code == grpc::StatusCode::ABORTED,
          "a page token of a stale round: " + a.ToString());
    std::printf("stale page token: %s\n", a.message.c_str());
  }
  std::printf("ha_participants: the follower answered as the leader\n");
  return 0;
}

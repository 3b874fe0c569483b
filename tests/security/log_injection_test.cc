// Log injection (issue 24, finding 5 and "What to build" 4): whatever bytes a
// peer puts in a run id, node name, group or member name, host, barrier id,
// error report, key, prefix, token label or TCPStore namespace, no log line
// it reaches starts with text the peer chose or holds a raw control byte.
// Checked on the logs themselves: cohortd's, and cohortrun's, which prints
// what other nodes of its run send through cohortd.
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cohort/v1/auth.grpc.pb.h"
#include "cohort/v1/coordination.grpc.pb.h"
#include "cohort/v1/store.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "proto/tcpstore/wire.h"
#include "tests/testing/cohortd_process.h"

namespace cohort {
namespace {

using testing::CohortdProcess;
using ::testing::HasSubstr;

constexpr char kAdmin[] = "admin-token-0123456789";
constexpr char kJob1[] = "job1-token-0123456789";

// What a forger wants a reader to take for a line of cohortd's own.
constexpr char kForged[] =
    "2026-11-27T00:00:00.000Z cohortd: FORGED admin token issued";

// `tag` and a forged line behind a control sequence that ends the line or
// moves the cursor: a newline, a carriage return, ANSI erase-line, and
// other C0 bytes and DEL.
std::vector<std::string> Hostile(absl::string_view tag) {
  return {absl::StrCat(tag, "\n", kForged), absl::StrCat(tag, "\r", kForged),
          absl::StrCat(tag, "\x1b[2K\r", kForged),
          absl::StrCat(tag, "\x01\x08\x7f\t", kForged)};
}

// How the first of Hostile(tag) reads once escaped.
std::string EscapedNewline(absl::string_view tag) {
  return absl::StrCat(tag, "\\n", kForged);
}

// Fails for every line of `log` that a peer forged (it starts with the
// forged text) or that holds a raw control byte.
void ExpectNoForgedLines(absl::string_view log, absl::string_view whose) {
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    EXPECT_FALSE(absl::StartsWith(line, kForged))
        << whose << " has a forged line: " << absl::CHexEscape(line);
    for (char c : line) {
      const auto byte = static_cast<unsigned char>(c);
      if (byte < 0x20 || byte == 0x7f) {
        ADD_FAILURE() << whose << " has a raw control byte "
                      << static_cast<int>(byte)
                      << " in: " << absl::CHexEscape(line);
        break;
      }
    }
  }
}

std::unique_ptr<grpc::ClientContext> As(const std::string& token) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
  context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  return context;
}

// A status message reaches the caller's log (cohortrun's, a worker's): it
// must carry no raw control byte either.
void ExpectClean(const grpc::Status& status, absl::string_view call) {
  for (char c : status.error_message()) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      ADD_FAILURE() << call << ": raw control byte in the status message "
                    << absl::CHexEscape(status.error_message());
      return;
    }
  }
}

// Sends `bytes` to the TCPStore listener and reads until cohortd closes
// the connection (or 60 s pass).
void TcpStoreSend(int port, const std::string& bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  struct sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  struct timeval timeout = {60, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ASSERT_EQ(write(fd, bytes.data(), bytes.size()),
            static_cast<ssize_t>(bytes.size()));
  char buf[256];
  while (read(fd, buf, sizeof(buf)) > 0) {
  }
  close(fd);
}

// A child process (cohortrun) whose stderr the test reads.
class Child {
 public:
  // Runs argv[0] with `argv` and a bare environment; stdout goes nowhere.
  explicit Child(std::vector<std::string> argv) {
    int fds[2];
    if (pipe(fds) != 0) return;
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    std::string path = "PATH=/usr/bin:/bin";
    char* env[] = {path.data(), nullptr};
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDERR_FILENO);
      const int null = open("/dev/null", O_WRONLY);
      dup2(null, STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      execve(args[0], args.data(), env);
      _exit(127);
    }
    close(fds[1]);
    stderr_fd_ = fds[0];
    fcntl(stderr_fd_, F_SETFL, O_NONBLOCK);
  }

  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (stderr_fd_ >= 0) close(stderr_fd_);
  }

  // Its exit status once it exited (128 if a signal ended it), or -1 while
  // it still runs after `give_up`.
  int Wait(absl::Duration give_up) {
    const absl::Time until = absl::Now() + give_up;
    for (;;) {
      int status = 0;
      if (pid_ <= 0) return exit_status_;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
        return exit_status_;
      }
      if (absl::Now() >= until) return -1;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // What it wrote to stderr so far.
  const std::string& Log() {
    char buf[4096];
    for (ssize_t n; (n = read(stderr_fd_, buf, sizeof(buf))) > 0;) {
      log_.append(buf, n);
    }
    return log_;
  }

 private:
  pid_t pid_ = -1;
  int exit_status_ = 127;  // What exec failing gives.
  int stderr_fd_ = -1;
  std::string log_;
};

class LogInjectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_ = absl::StrCat(::testing::TempDir(), "/log_injection_tokens");
    std::ofstream(tokens_) << kAdmin << " admin *\n" << kJob1 << " rw job1/\n";
    auto server = CohortdProcess::Start(
        {"--engine=memory", absl::StrCat("--auth_tokens=", tokens_)});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::make_unique<CohortdProcess>(std::move(*server));
    channel_ = grpc::CreateChannel(server_->address(),
                                   grpc::InsecureChannelCredentials());
    rendezvous_ = v1::Rendezvous::NewStub(channel_);
    membership_ = v1::Membership::NewStub(channel_);
    store_ = v1::Store::NewStub(channel_);
    auth_ = v1::Auth::NewStub(channel_);
  }

  // cohortd passes at most one line a second per cause, so a call whose
  // line the test looks for comes more than a second after the last one
  // returned (cohortd logs before it answers).
  static void Spaced() { absl::SleepFor(absl::Milliseconds(1100)); }

  std::string tokens_;
  std::unique_ptr<CohortdProcess> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Rendezvous::Stub> rendezvous_;
  std::unique_ptr<v1::Membership::Stub> membership_;
  std::unique_ptr<v1::Store::Stub> store_;
  std::unique_ptr<v1::Auth::Stub> auth_;
};

// Every RPC that makes cohortd log, and the ones that reach the
// coordination state machines, fed hostile strings by a job token; the
// status messages they answer with, which callers log, are checked too.
TEST_F(LogInjectionTest, CohortdLogsPeerStringsEscaped) {
  // Refused as outside the job's grant: each refusal is logged, with the
  // name it refused.
  std::vector<std::string> logged;  // Tags whose escaped form must appear.
  {
    Spaced();
    v1::JoinRequest join;
    join.set_run_id(Hostile("join-run")[0]);
    join.set_node_id("n0");
    join.set_local_world_size(1);
    join.set_min_nodes(1);
    join.set_max_nodes(1);
    v1::JoinResponse resp;
    grpc::Status s = rendezvous_->Join(As(kJob1).get(), join, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    ExpectClean(s, "Join");
    logged.push_back("join-run");
  }
  {
    Spaced();
    v1::GetRunStateRequest req;
    req.set_run_id(Hostile("state-run")[0]);
    v1::RunState resp;
    grpc::Status s = rendezvous_->GetRunState(As(kJob1).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    logged.push_back("state-run");
  }
  {
    Spaced();
    v1::JoinGroupRequest req;
    req.set_group(Hostile("join-group")[0]);
    req.set_name("m0");
    v1::JoinGroupResponse resp;
    grpc::Status s = membership_->JoinGroup(As(kJob1).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    logged.push_back("join-group");
  }
  {
    Spaced();
    v1::BarrierRequest req;
    req.set_group(Hostile("barrier-group")[0]);
    req.set_barrier_id("b");
    req.set_name("m0");
    v1::BarrierResponse resp;
    grpc::Status s = membership_->Barrier(As(kJob1).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    logged.push_back("barrier-group");
  }
  {
    Spaced();
    v1::SetRequest req;
    req.set_key(Hostile("set-key")[0]);
    req.set_value("v");
    v1::SetResponse resp;
    grpc::Status s = store_->Set(As(kJob1).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    logged.push_back("set-key");
  }
  {
    Spaced();
    v1::ListKeysRequest req;
    req.set_prefix(Hostile("list-prefix")[0]);
    v1::ListKeysResponse resp;
    grpc::Status s = store_->ListKeys(As(kJob1).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    logged.push_back("list-prefix");
  }
  {
    // Issued by the admin with a hostile label: logged as an issue.
    Spaced();
    v1::IssueTokenRequest req;
    req.set_role(v1::READ_WRITE);
    req.set_prefix("job1/");
    req.set_description(Hostile("label")[0]);
    v1::IssueTokenResponse resp;
    grpc::Status s = auth_->IssueToken(As(kAdmin).get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  {
    // A job issuing outside its prefix: logged as a denial.
    Spaced();
    v1::IssueTokenRequest req;
    req.set_role(v1::READ);
    req.set_prefix("job2/\xc3\xa9\"'issue-prefix");
    req.set_description(Hostile("label")[1]);
    v1::IssueTokenResponse resp;
    grpc::Status s = auth_->IssueToken(As(kJob1).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  for (const std::string& prefix : Hostile("job1/token-prefix")) {
    v1::IssueTokenRequest req;
    req.set_role(v1::READ);
    req.set_prefix(prefix);
    v1::IssueTokenResponse resp;
    grpc::Status s = auth_->IssueToken(As(kJob1).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    ExpectClean(s, "IssueToken");
  }
  {
    v1::RevokeTokenRequest req;
    req.set_id(Hostile("revoke")[0]);
    v1::RevokeTokenResponse resp;
    grpc::Status s = auth_->RevokeToken(As(kJob1).get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    ExpectClean(s, "RevokeToken");
  }

  // Within the grant: the run and group job1 with hostile node and member
  // names, hosts, barrier ids and error reports. cohortd logs none of
  // them, and must go on logging none raw.
  for (const std::string& hostile : Hostile("inside")) {
    v1::JoinRequest join;
    join.set_run_id("job1");
    join.set_node_id(hostile);
    join.set_address(hostile);
    join.set_local_world_size(1);
    join.set_min_nodes(1);
    join.set_max_nodes(1);
    v1::JoinResponse joined;
    grpc::Status s = rendezvous_->Join(As(kJob1).get(), join, &joined);
    EXPECT_TRUE(s.ok()) << absl::CHexEscape(s.error_message());

    v1::JoinGroupRequest member;
    member.set_group("job1");
    member.set_name(hostile);
    member.set_host(hostile);
    member.set_rank(0);
    v1::JoinGroupResponse in;
    s = membership_->JoinGroup(As(kJob1).get(), member, &in);
    ASSERT_TRUE(s.ok()) << absl::CHexEscape(s.error_message());

    // The same run with other bounds: refused, naming the node.
    join.set_min_nodes(2);
    join.set_max_nodes(2);
    s = rendezvous_->Join(As(kJob1).get(), join, &joined);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    ExpectClean(s, "Join with other bounds");

    v1::GetRunStateRequest state;
    state.set_run_id(hostile);
    v1::RunState state_resp;
    s = rendezvous_->GetRunState(As(kAdmin).get(), state, &state_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    ExpectClean(s, "GetRunState");

    v1::HeartbeatRequest beat;
    beat.set_group("job1");
    beat.set_name(hostile);
    beat.set_incarnation(in.incarnation() + 1);
    v1::HeartbeatResponse beat_resp;
    s = membership_->Heartbeat(As(kJob1).get(), beat, &beat_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    ExpectClean(s, "Heartbeat");

    // A barrier naming a participant that is not a member ends at once.
    v1::BarrierRequest barrier;
    barrier.set_group("job1");
    barrier.set_barrier_id(hostile);
    barrier.set_name(hostile);
    barrier.set_incarnation(in.incarnation());
    barrier.add_participants(hostile);
    barrier.add_participants(absl::StrCat("gone", hostile));
    v1::BarrierResponse barrier_resp;
    s = membership_->Barrier(As(kJob1).get(), barrier, &barrier_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
    ExpectClean(s, "Barrier");

    barrier.set_barrier_id(absl::StrCat("not-in", hostile));
    barrier.clear_participants();
    barrier.add_participants(absl::StrCat("other", hostile));
    s = membership_->Barrier(As(kJob1).get(), barrier, &barrier_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    ExpectClean(s, "Barrier without the caller");

    // A live peer that never arrives: the timeout names it by its host.
    v1::JoinGroupRequest peer = member;
    peer.set_name(absl::StrCat("peer", hostile));
    peer.set_rank(1);
    v1::JoinGroupResponse peer_in;
    s = membership_->JoinGroup(As(kJob1).get(), peer, &peer_in);
    ASSERT_TRUE(s.ok()) << absl::CHexEscape(s.error_message());
    barrier.set_barrier_id(absl::StrCat("timeout", hostile));
    barrier.clear_participants();
    barrier.add_participants(hostile);
    barrier.add_participants(peer.name());
    barrier.set_timeout_ms(1);
    s = membership_->Barrier(As(kJob1).get(), barrier, &barrier_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    ExpectClean(s, "Barrier timing out");
    EXPECT_THAT(s.error_message(), HasSubstr("rank 1 (inside\\"));

    v1::ReportErrorRequest report;
    report.set_group("job1");
    report.set_name(hostile);
    report.set_incarnation(in.incarnation());
    report.set_message(hostile);
    v1::ReportErrorResponse report_resp;
    s = membership_->ReportError(As(kJob1).get(), report, &report_resp);
    EXPECT_TRUE(s.ok()) << absl::CHexEscape(s.error_message());

    v1::LeaveGroupRequest leave;
    leave.set_group("job1");
    leave.set_name(hostile);
    leave.set_incarnation(in.incarnation());
    v1::LeaveGroupResponse left;
    s = membership_->LeaveGroup(As(kJob1).get(), leave, &left);
    EXPECT_TRUE(s.ok()) << absl::CHexEscape(s.error_message());
  }

  // TCPStore hellos: a namespace outside the grant (logged as a denial and
  // as the connection closing), one that breaks the namespace rules, and
  // bytes that are no request after a good hello.
  {
    Spaced();
    std::string hello;
    tcpstore::EncodeNamespaceHello(
        absl::StrCat("/", Hostile("tcpstore-ns")[0], "/"), &hello, kJob1);
    TcpStoreSend(server_->tcpstore_port(), hello);
    logged.push_back("tcpstore-ns");
  }
  {
    // Encoded as the wire has it, though CheckNamespace refuses it: what a
    // hostile client sends.
    Spaced();
    std::string hello;
    tcpstore::EncodeNamespaceHello(Hostile("bad-ns")[0], &hello, kJob1);
    TcpStoreSend(server_->tcpstore_port(), hello);
  }
  {
    Spaced();
    std::string hello;
    tcpstore::EncodeNamespaceHello("/cohortrun/job1/0/", &hello, kJob1);
    absl::StrAppend(&hello, Hostile("req")[0]);
    TcpStoreSend(server_->tcpstore_port(), hello);
  }

  const std::string log = server_->Log();
  ExpectNoForgedLines(log, "cohortd's log");
  for (const std::string& tag : logged) {
    EXPECT_THAT(log, HasSubstr(EscapedNewline(tag)))
        << "no line shows " << tag << " escaped:\n"
        << log;
  }
  EXPECT_THAT(log, HasSubstr("job2/\\xc3\\xa9\\\"\\'issue-prefix"));
  // Cut short in these lines, but escaped.
  EXPECT_THAT(log, HasSubstr("bad-ns\\n2026"));
  EXPECT_THAT(log, HasSubstr("req\\n2026"));
}

// cohortrun prints what the other nodes of its run send it through cohortd:
// their node names, and the errors they report. A hostile node (the test,
// with the job's token) joins run job1 beside a real cohortrun, passes the
// start barrier and reports an error; cohortrun gives up naming it.
TEST_F(LogInjectionTest, CohortrunLogsPeerStringsEscaped) {
  const std::string token_file =
      absl::StrCat(::testing::TempDir(), "/log_injection_job1_token");
  std::ofstream(token_file) << kJob1 << "\n";
  Child cohortrun(
      {"worker/launch/cohortrun",
       absl::StrCat("--coordinator=", server_->address()),
       absl::StrCat("--tcpstore=127.0.0.1:", server_->tcpstore_port()),
       "--run-id=job1", "--node-id=a", "--nnodes=2:2", "--max-restarts=0",
       "--heartbeat-interval=1s", "--stop-grace=1s",
       absl::StrCat("--token-file=", token_file), "--", "/bin/sleep", "600"});

  const std::string node = Hostile("node")[0];
  v1::JoinRequest join;
  join.set_run_id("job1");
  join.set_node_id(node);
  join.set_address(Hostile("address")[0]);
  join.set_local_world_size(1);
  join.set_min_nodes(2);
  join.set_max_nodes(2);
  v1::JoinResponse joined;
  grpc::Status s = rendezvous_->Join(As(kJob1).get(), join, &joined);
  ASSERT_TRUE(s.ok()) << absl::CHexEscape(s.error_message()) << "\n"
                      << cohortrun.Log();

  v1::JoinGroupRequest member;
  member.set_group("job1");
  member.set_name(node);
  member.set_host(Hostile("host")[0]);
  member.set_rank(joined.node_rank());
  member.set_heartbeat_interval_ms(60000);
  v1::JoinGroupResponse in;
  s = membership_->JoinGroup(As(kJob1).get(), member, &in);
  ASSERT_TRUE(s.ok()) << absl::CHexEscape(s.error_message());

  // A barrier that names a node not yet in the group ends at once: wait
  // for cohortrun's node to join it, as cohortrun waits for this one.
  for (bool in_group = false; !in_group;) {
    ASSERT_EQ(cohortrun.Wait(absl::ZeroDuration()), -1) << cohortrun.Log();
    v1::ListMembersRequest list;
    list.set_group("job1");
    v1::ListMembersResponse members;
    s = membership_->ListMembers(As(kJob1).get(), list, &members);
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (const v1::MemberInfo& m : members.members())
      in_group |= m.name() == "a";
    if (!in_group) absl::SleepFor(absl::Milliseconds(20));
  }

  v1::BarrierRequest start;
  start.set_group("job1");
  start.set_barrier_id(
      absl::StrCat("cohortrun.round-", joined.round(), ".start"));
  start.set_name(node);
  start.set_incarnation(in.incarnation());
  for (const v1::Participant& p : joined.participants()) {
    start.add_participants(p.node_id());
  }
  start.set_timeout_ms(60000);
  v1::BarrierResponse started;
  s = membership_->Barrier(As(kJob1).get(), start, &started);
  ASSERT_TRUE(s.ok()) << absl::CHexEscape(s.error_message()) << "\n"
                      << cohortrun.Log();

  v1::ReportErrorRequest report;
  report.set_group("job1");
  report.set_name(node);
  report.set_incarnation(in.incarnation());
  report.set_message(absl::StrCat(Hostile("report")[0], "\x1b[2J"));
  v1::ReportErrorResponse reported;
  s = membership_->ReportError(As(kJob1).get(), report, &reported);
  ASSERT_TRUE(s.ok()) << absl::CHexEscape(s.error_message());

  // No restarts allowed: it gives up, with the peer's error.
  EXPECT_EQ(cohortrun.Wait(absl::Seconds(60)), 1) << cohortrun.Log();
  const std::string log = cohortrun.Log();
  ExpectNoForgedLines(log, "cohortrun's log");
  EXPECT_THAT(log, HasSubstr(absl::StrCat("peer ", EscapedNewline("node"))))
      << log;
  EXPECT_THAT(log, HasSubstr(EscapedNewline("report"))) << log;
  ExpectNoForgedLines(server_->Log(), "cohortd's log");
}

}  // namespace
}  // namespace cohort

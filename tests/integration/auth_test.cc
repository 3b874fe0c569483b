// cohortd with tokens, in-process, through real gRPC: rendezvous and
// membership calls are scoped to the token's prefix like keys are, the
// reserved namespace keeps issued tokens' digests out of a job's reach, and
// ten thousand failed authentications leave cohortd serving, counted, with
// bounded memory.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/remote_store.h"
#include "cohort/v1/auth.grpc.pb.h"
#include "cohort/v1/coordination.grpc.pb.h"
#include "cohort/v1/store.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "proto/tcpstore/wire.h"
#include "server/cohort_server.h"
#include "store/kv_engine.h"

namespace cohort {
namespace {

using ::testing::HasSubstr;

constexpr char kAdmin[] = "admin-token-0123456789";
constexpr char kJob1[] = "job1-token-0123456789";
constexpr char kReader[] = "job1-reader-0123456789";

// This process's resident memory, in bytes.
int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      std::vector<std::string> fields =
          absl::StrSplit(line, ' ', absl::SkipEmpty());
      int64_t kib = 0;
      if (fields.size() >= 2 && absl::SimpleAtoi(fields[1], &kib)) {
        return kib * 1024;
      }
    }
  }
  return -1;
}

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_ = absl::StrCat(::testing::TempDir(), "/tokens");
    std::ofstream(tokens_) << kAdmin << " admin *\n"
                           << kJob1 << " rw job1/\n"
                           << kReader << " r job1/\n";
    auto server = server::CohortServer::Start(
        std::make_unique<store::KvStore>(store::NewMemoryEngine()),
        {.listen = "127.0.0.1:0", .auth_tokens = tokens_});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
    rendezvous_ = v1::Rendezvous::NewStub(channel_);
    membership_ = v1::Membership::NewStub(channel_);
  }

  std::unique_ptr<RemoteStore> Client(const std::string& token) {
    RemoteStoreOptions options;
    options.address = absl::StrCat("127.0.0.1:", server_->port());
    options.token = token;
    options.credentials_from_env = false;
    options.max_attempts = 1;
    auto client = RemoteStore::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return std::move(*client);
  }

  // A context carrying `token`, with a deadline.
  static std::unique_ptr<grpc::ClientContext> As(const std::string& token) {
    auto context = std::make_unique<grpc::ClientContext>();
    context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
    context->set_deadline(
        absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return context;
  }

  std::string tokens_;
  std::unique_ptr<server::CohortServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Rendezvous::Stub> rendezvous_;
  std::unique_ptr<v1::Membership::Stub> membership_;
};

TEST_F(AuthTest, RunsAndGroupsAreScopedToTheTokensPrefix) {
  v1::JoinRequest join;
  join.set_run_id("job2");
  join.set_node_id("n0");
  join.set_local_world_size(1);
  join.set_min_nodes(1);
  join.set_max_nodes(1);
  v1::JoinResponse joined;
  grpc::Status s = rendezvous_->Join(As(kJob1).get(), join, &joined);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("prefix 'job1/'"));
  EXPECT_THAT(s.error_message(), HasSubstr("run 'job2'"));

  join.set_run_id("job1");
  s = rendezvous_->Join(As(kReader).get(), join, &joined);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("read-only"));
  s = rendezvous_->Join(As(kJob1).get(), join, &joined);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(joined.store_prefix(), "runs/job1/0");
  // The store prefix the rendezvous handed out is within the token.
  auto job1 = Client(kJob1);
  EXPECT_TRUE(job1->Set("runs/job1/0/x", "1").ok());
  EXPECT_EQ(job1->Set("runs/job2/0/x", "1").code(),
            absl::StatusCode::kPermissionDenied);

  v1::GetRunStateRequest state;
  state.set_run_id("job1");
  v1::RunState run;
  EXPECT_TRUE(rendezvous_->GetRunState(As(kReader).get(), state, &run).ok());
  state.set_run_id("job2");
  EXPECT_EQ(rendezvous_->GetRunState(As(kReader).get(), state, &run)
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  v1::JoinGroupRequest group;
  group.set_group("job2");
  group.set_name("n0");
  v1::JoinGroupResponse member;
  EXPECT_EQ(membership_->JoinGroup(As(kJob1).get(), group, &member)
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  group.set_group("job1");
  ASSERT_TRUE(membership_->JoinGroup(As(kJob1).get(), group, &member).ok());

  v1::WatchMembersRequest watch;
  watch.set_group("job2");
  auto context = As(kJob1);
  auto reader = membership_->WatchMembers(context.get(), watch);
  v1::WatchMembersResponse events;
  EXPECT_FALSE(reader->Read(&events));
  EXPECT_EQ(reader->Finish().error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  v1::BarrierRequest barrier;
  barrier.set_group("job2");
  barrier.set_barrier_id("b");
  barrier.set_name("n0");
  v1::BarrierResponse passed;
  EXPECT_EQ(membership_->Barrier(As(kJob1).get(), barrier, &passed)
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  // Without a token at all.
  grpc::ClientContext anonymous;
  EXPECT_EQ(rendezvous_->Join(&anonymous, join, &joined).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

// Sibling jobs named as job1 extended (job10, job1.other) beside job1's
// own keys. Whatever prefix job1's tokens list, watch (live and from
// history) or count under, they get job1's keys and never a sibling's.
TEST_F(AuthTest, ListWatchAndNumKeysNeverReachSiblingJobs) {
  const std::vector<std::string> siblings = {
      "job10/secret", "job1.other/secret", "runs/job10/0/addr",
      "/cohortrun/job10/0/nccl_id"};
  const std::vector<std::string> own = {"job1/a", "runs/job1/0/addr",
                                        "/cohortrun/job1/0/nccl_id"};
  auto admin = Client(kAdmin);
  for (const std::string& key : siblings) ASSERT_TRUE(admin->Set(key, "x").ok());
  for (const std::string& key : own) ASSERT_TRUE(admin->Set(key, "y").ok());
  auto covered = [](const std::string& key) {
    return absl::StartsWith(key, "job1/") ||
           absl::StartsWith(key, "runs/job1/") ||
           absl::StartsWith(key, "/cohortrun/job1/");
  };
  auto store = v1::Store::NewStub(channel_);
  const std::vector<std::string> prefixes = {
      "", "j", "job", "job1", "job1/", "runs/", "runs/job1",
      "/cohortrun/job1", "/cohortrun/job1/0/"};
  for (const char* token : {kJob1, kReader}) {
    for (const std::string& prefix : prefixes) {
      v1::ListKeysRequest list;
      list.set_prefix(prefix);
      v1::ListKeysResponse listed;
      grpc::Status s = store->ListKeys(As(token).get(), list, &listed);
      ASSERT_TRUE(s.ok()) << "'" << prefix << "': " << s.error_message();
      EXPECT_EQ(listed.keys_size(), 1) << "'" << prefix << "'";
      for (const std::string& key : listed.keys()) {
        EXPECT_TRUE(covered(key)) << "listing '" << prefix << "' gave " << key;
      }
    }
    for (const char* prefix : {"job10", "job1.", "runs/job10",
                                      "/cohortrun/job10/"}) {
      v1::ListKeysRequest list;
      list.set_prefix(prefix);
      v1::ListKeysResponse listed;
      EXPECT_EQ(store->ListKeys(As(token).get(), list, &listed).error_code(),
                grpc::StatusCode::PERMISSION_DENIED)
          << "'" << prefix << "'";
    }
    v1::NumKeysResponse counted;
    ASSERT_TRUE(
        store->NumKeys(As(token).get(), v1::NumKeysRequest(), &counted).ok());
    EXPECT_EQ(counted.num_keys(), 1);  // job1/a alone.
  }

  // Watches from the first revision (history), then live: a sibling's write
  // is committed before job1's marker, so in revision order it would have
  // come first had it leaked.
  for (const std::string prefix : {"job1", "runs/job1", "/cohortrun/job1"}) {
    auto context = As(kReader);
    context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    v1::WatchRequest watch;
    watch.set_prefix(prefix);
    watch.set_from_revision(1);
    auto reader = store->Watch(context.get(), watch);
    const std::string root = prefix == "job1" ? "job1/" : prefix + "/";
    const std::string sibling =
        prefix == "job1" ? "job10/live" : absl::StrCat(prefix, "0/live");
    const std::string marker = absl::StrCat(root, "marker");
    ASSERT_TRUE(admin->Set(sibling, "leak").ok());
    ASSERT_TRUE(admin->Set(marker, "m").ok());
    std::vector<std::string> seen;
    v1::WatchResponse events;
    while (std::find(seen.begin(), seen.end(), marker) == seen.end() &&
           reader->Read(&events)) {
      for (const v1::Event& e : events.events()) seen.push_back(e.key());
    }
    context->TryCancel();
    while (reader->Read(&events)) {
    }
    reader->Finish().IgnoreError();
    EXPECT_NE(std::find(seen.begin(), seen.end(), marker), seen.end())
        << "watch '" << prefix << "' ended before job1's marker";
    EXPECT_GE(seen.size(), 2u) << "watch '" << prefix
                               << "' replayed none of job1's history";
    for (const std::string& key : seen) {
      EXPECT_TRUE(covered(key)) << "watch '" << prefix << "' gave " << key;
    }
  }
}

TEST_F(AuthTest, IssuedTokensDigestsAreOutOfAJobsReach) {
  auto admin = Client(kAdmin);
  auto job1 = Client(kJob1);
  auto auth = server_->auth();
  ASSERT_NE(auth, nullptr);
  auto issued = auth->Issue(*auth->AuthenticateToken(kAdmin),
                            [] {
                              v1::IssueTokenRequest r;
                              r.set_role(v1::READ);
                              r.set_prefix("job1/");
                              return r;
                            }());
  ASSERT_TRUE(issued.ok());
  auto listed = job1->ListKeys("/cohort/auth/");
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kPermissionDenied);
  auto all = admin->ListKeys(server::kIssuedTokensPrefix);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->keys.size(), 1u);
  EXPECT_THAT(all->keys[0], HasSubstr(issued->id()));
  // Not even an admin may write cohortd's records by hand.
  EXPECT_EQ(admin->Set(all->keys[0], "forged").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(Client(issued->token())->Get("job1/none", absl::Milliseconds(1))
                  .status()
                  .code() == absl::StatusCode::kDeadlineExceeded);
}

TEST_F(AuthTest, TenThousandFailedAuthenticationsLeaveItServing) {
  auto garbage = Client("garbage-token-0123456789");
  auto job1 = Client(kJob1);
  // Warm up gRPC's pools before measuring.
  for (int i = 0; i < 1000; ++i) {
    ASSERT_EQ(garbage->Set("job1/k", "v").code(),
              absl::StatusCode::kUnauthenticated);
  }
  [[maybe_unused]] const int64_t before = ResidentBytes();
  for (int i = 0; i < 10000; ++i) {
    absl::Status s = garbage->Set("job1/k", "v");
    ASSERT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  }
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // (A sanitizer's quarantine and shadow memory grow by design.)
  const int64_t after = ResidentBytes();
  EXPECT_LT(after - before, 16 << 20)
      << "resident memory grew from " << before << " to " << after;
#endif
  EXPECT_EQ(server_->auth()->stats().unknown_token, 11000u);
  EXPECT_TRUE(job1->Set("job1/k", "v").ok());
  EXPECT_EQ(*job1->Get("job1/k", absl::Seconds(1)), "v");
}

// Polls `done` (a state of the server) until it holds; fails the test if
// it never does.
template <typename Done>
bool Eventually(Done done) {
  for (int i = 0; i < 12000 && !done(); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  return done();
}

v1::IssueTokenResponse IssueAs(server::Authenticator* auth,
                               const std::string& token,
                               const std::string& prefix) {
  absl::StatusOr<server::Grant> by = auth->AuthenticateToken(token);
  EXPECT_TRUE(by.ok()) << by.status();
  v1::IssueTokenRequest request;
  request.set_role(v1::READ_WRITE);
  request.set_prefix(prefix);
  absl::StatusOr<v1::IssueTokenResponse> issued =
      auth->Issue(by.value_or(server::Grant()), request);
  EXPECT_TRUE(issued.ok()) << issued.status();
  return issued.value_or(v1::IssueTokenResponse());
}

// Finding 2: revoking a token's issuer ends the calls it has in flight. A
// worker (issued by a token job1 issued) watches job1/ and has a Get and a
// Wait parked; job1 revokes the worker's issuer, then writes what they
// wait for and a change under the watch. Each ends UNAUTHENTICATED with
// nothing of what was written after.
TEST_F(AuthTest, RevokingAnIssuerEndsItsWatchesAndParkedWaits) {
  server::Authenticator* auth = server_->auth();
  const v1::IssueTokenResponse issuer = IssueAs(auth, kJob1, "job1/");
  const v1::IssueTokenResponse worker = IssueAs(auth, issuer.token(), "job1/");
  auto store = v1::Store::NewStub(channel_);
  auto job = Client(kJob1);

  auto watch_context = As(worker.token());
  watch_context->set_deadline(
      absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
  v1::WatchRequest watch;
  watch.set_prefix("job1/");
  auto reader = store->Watch(watch_context.get(), watch);
  v1::WatchResponse message;
  ASSERT_TRUE(reader->Read(&message));  // The start revision.
  ASSERT_TRUE(job->Set("job1/before", "1").ok());
  ASSERT_TRUE(reader->Read(&message));
  ASSERT_EQ(message.events_size(), 1);
  EXPECT_EQ(message.events(0).key(), "job1/before");

  auto getter_client = Client(worker.token());
  auto waiter_client = Client(worker.token());
  absl::StatusOr<std::string> got;
  absl::Status waited;
  std::thread getter(
      [&] { got = getter_client->Get("job1/later", absl::Minutes(10)); });
  std::thread waiter([&] {
    waited =
        waiter_client->Wait({std::string("job1/later2")}, absl::Minutes(10));
  });
  ASSERT_TRUE(
      Eventually([&] { return server_->store().stats().waiters == 2; }));

  auto auth_stub = v1::Auth::NewStub(channel_);
  v1::RevokeTokenRequest revoke;
  revoke.set_id(issuer.id());
  v1::RevokeTokenResponse revoked;
  grpc::Status s = auth_stub->RevokeToken(As(kJob1).get(), revoke, &revoked);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(job->Set("job1/later", "secret").ok());
  ASSERT_TRUE(job->Set("job1/later2", "x").ok());
  ASSERT_TRUE(job->Set("job1/after", "secret").ok());

  getter.join();
  waiter.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnauthenticated)
      << (got.ok() ? "got the value '" + *got + "'" : got.status().ToString());
  EXPECT_THAT(got.status().message(), HasSubstr("revoked"));
  EXPECT_EQ(waited.code(), absl::StatusCode::kUnauthenticated) << waited;
  std::vector<std::string> after;
  while (std::find(after.begin(), after.end(), "job1/after") == after.end() &&
         reader->Read(&message)) {
    for (const v1::Event& e : message.events()) after.push_back(e.key());
  }
  // Still open (the defect): end it, so that Finish returns.
  if (!after.empty()) watch_context->TryCancel();
  grpc::Status finished = reader->Finish();
  EXPECT_EQ(finished.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << finished.error_message();
  EXPECT_THAT(finished.error_message(), HasSubstr("revoked"));
  EXPECT_THAT(after, ::testing::IsEmpty());
  // The store holds the ended waits no longer.
  EXPECT_TRUE(
      Eventually([&] { return server_->store().stats().waiters == 0; }));
  EXPECT_GE(auth->stats().calls_ended, 3u);
}

// Membership's WatchMembers streams are calls that last too: each counts
// against its tenant's watch streams, and ends when its token is revoked.
TEST_F(AuthTest, RevokingATokenEndsItsMembershipWatch) {
  const v1::IssueTokenResponse worker =
      IssueAs(server_->auth(), kJob1, "job1/");
  auto members = v1::Membership::NewStub(channel_);
  auto context = As(worker.token());
  context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  v1::WatchMembersRequest watch;
  watch.set_group("job1/workers");
  auto reader = members->WatchMembers(context.get(), watch);
  v1::WatchMembersResponse message;
  ASSERT_TRUE(reader->Read(&message));  // The start revision.
  const auto streams = [&] {
    return server_->quotas()
        ->stats()
        .used[static_cast<int>(server::Quota::kWatchStreams)];
  };
  EXPECT_EQ(streams(), 1u);

  auto auth_stub = v1::Auth::NewStub(channel_);
  v1::RevokeTokenRequest revoke;
  revoke.set_id(worker.id());
  v1::RevokeTokenResponse revoked;
  grpc::Status s = auth_stub->RevokeToken(As(kJob1).get(), revoke, &revoked);
  ASSERT_TRUE(s.ok()) << s.error_message();
  while (reader->Read(&message)) {
  }
  grpc::Status finished = reader->Finish();
  EXPECT_EQ(finished.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << finished.error_code() << ": " << finished.error_message();
  EXPECT_THAT(finished.error_message(), HasSubstr("revoked"));
  EXPECT_TRUE(Eventually([&] { return streams() == 0; }));
}

// A record deleted without this cohortd's Authenticator (as another
// replica over the same etcd revokes) ends the token's watch all the same.
TEST_F(AuthTest, ARecordDeletedInTheStoreEndsItsWatch) {
  const v1::IssueTokenResponse worker =
      IssueAs(server_->auth(), kJob1, "job1/");
  auto store = v1::Store::NewStub(channel_);
  auto context = As(worker.token());
  context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(2)));
  v1::WatchRequest watch;
  watch.set_prefix("job1/");
  auto reader = store->Watch(context.get(), watch);
  v1::WatchResponse message;
  ASSERT_TRUE(reader->Read(&message));
  ASSERT_TRUE(
      server_->store()
          .Delete(absl::StrCat(server::kIssuedTokensPrefix, worker.id()))
          .ok());
  while (reader->Read(&message)) {
  }
  grpc::Status finished = reader->Finish();
  EXPECT_EQ(finished.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << finished.error_message();
}

// Finding 4: issuing is rate-limited per tenant (a file token and what it
// issued), naming the flags; another tenant issues on.
TEST(AuthLimitsTest, IssuingOverTheRateIsRefusedNamingTheFlags) {
  const std::string tokens =
      absl::StrCat(::testing::TempDir(), "/tokens-limits");
  std::ofstream(tokens) << kAdmin << " admin *\n" << kJob1 << " rw job1/\n";
  auto server = server::CohortServer::Start(
      std::make_unique<store::KvStore>(store::NewMemoryEngine()),
      {.listen = "127.0.0.1:0",
       .auth_tokens = tokens,
       // Two at once, then one every 1,000 s: none refills in the test.
       .token_issue_limits = {.rate = 0.001, .burst = 2}});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                          grpc::InsecureChannelCredentials());
  auto auth = v1::Auth::NewStub(channel);
  auto issue = [&](const std::string& token, const std::string& prefix,
                   v1::IssueTokenResponse* issued) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    v1::IssueTokenRequest request;
    request.set_role(v1::READ_WRITE);
    request.set_prefix(prefix);
    return auth->IssueToken(&context, request, issued);
  };
  v1::IssueTokenResponse child, other;
  ASSERT_TRUE(issue(kJob1, "job1/a/", &child).ok());
  ASSERT_TRUE(issue(child.token(), "job1/a/b/", &other).ok());
  for (const std::string& token : {std::string(kJob1), child.token()}) {
    grpc::Status refused = issue(token, "job1/a/c/", &other);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(refused.error_message(), HasSubstr("--token_issue_rate"));
  }
  for (int i = 0; i < 2; ++i) {
    grpc::Status s = issue(kAdmin, "job2/", &other);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ((*server)->auth()->stats().issue_rate_limited, 2u);
}

// A TCPStore token hello binds a namespace that starts every key of the
// connection, so the namespace must lie wholly within the token's prefix:
// checked as one key, the bare-name rule let a token for "job1//" (which
// job1's token may issue) bind "/cohortrun/job1/" and reach job1's keys
// outside its own.
// Found by tests/fuzz/auth_decision_fuzz's model. Also: a connection whose
// token is revoked is closed at its next request.
TEST(AuthTcpStoreTest, AHelloNamespaceMustLieWithinTheTokensPrefix) {
  const std::string tokens = absl::StrCat(::testing::TempDir(), "/tokens-ts");
  std::ofstream(tokens) << kAdmin << " admin *\n" << kJob1 << " rw job1/\n";
  auto server = server::CohortServer::Start(
      std::make_unique<store::KvStore>(store::NewMemoryEngine()),
      {.listen = "127.0.0.1:0",
       .tcpstore_listen = "127.0.0.1:0",
       .auth_tokens = tokens});
  ASSERT_TRUE(server.ok()) << server.status();
  const v1::IssueTokenResponse narrow =
      IssueAs((*server)->auth(), kJob1, "job1//");
  // Whether a connection with this hello is served: it answers a PING
  // (PyTorch 2.1+'s protocol) rather than closing.
  auto served = [&](const std::string& name_space, const std::string& token,
                    int* kept = nullptr) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((*server)->tcpstore_port());
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr))) {
      close(fd);
      return false;
    }
    std::string bytes;
    tcpstore::EncodeNamespaceHello(name_space, &bytes, token);
    tcpstore::Request validate, ping;
    validate.op = tcpstore::Op::kValidate;
    validate.word = tcpstore::kValidateMagic;
    ping.op = tcpstore::Op::kPing;
    ping.word = 7;
    tcpstore::EncodeRequest(tcpstore::Dialect::kTorch21, validate, &bytes);
    tcpstore::EncodeRequest(tcpstore::Dialect::kTorch21, ping, &bytes);
    char echo[4];
    const bool ok = send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
                        static_cast<ssize_t>(bytes.size()) &&
                    recv(fd, echo, 4, MSG_WAITALL) == 4;
    if (ok && kept != nullptr) {
      *kept = fd;
    } else {
      close(fd);
    }
    return ok;
  };
  // Namespaces start with "/": a job's torch stores are under /cohortrun/.
  EXPECT_TRUE(served("/cohortrun/job1//w/", narrow.token()));
  EXPECT_FALSE(served("/cohortrun/job1/", narrow.token()));
  EXPECT_TRUE(served("/cohortrun/job1/", kJob1));

  // Revoked: its connection is closed at the next request.
  int fd = -1;
  ASSERT_TRUE(served("/cohortrun/job1//w/", narrow.token(), &fd));
  auto auth = v1::Auth::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                          grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Bearer ", kJob1));
  v1::RevokeTokenRequest revoke;
  revoke.set_id(narrow.id());
  v1::RevokeTokenResponse revoked;
  ASSERT_TRUE(auth->RevokeToken(&context, revoke, &revoked).ok());
  tcpstore::Request ping;
  ping.op = tcpstore::Op::kPing;
  ping.word = 8;
  std::string bytes;
  tcpstore::EncodeRequest(tcpstore::Dialect::kTorch21, ping, &bytes);
  ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));
  char echo[4];
  EXPECT_LE(recv(fd, echo, 4, MSG_WAITALL), 0) << "the revoked token's PING "
                                                  "was answered";
  close(fd);
  EXPECT_GE((*server)->tcpstore_stats().refused_unauthenticated, 2u);
}

}  // namespace
}  // namespace cohort

// GetServerInfo: the address rules from strings, then an in-process cohortd
// answering over gRPC, with auth off and on.
#include "server/rpc/info_service.h"

#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "cohort/v1/info.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/cohort_server.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"

namespace cohort::server {
namespace {

using ::testing::HasSubstr;

TEST(DialTcpStoreAtTest, AdvertisedWinsThenBoundThenTheCallersHost) {
  const auto dial = [](absl::string_view bound, absl::string_view advertise,
                       absl::string_view authority) {
    TcpStoreDialAddress d =
        DialTcpStoreAt(bound, advertise, authority, "node7");
    return absl::StrCat(d.address, " ",
                        v1::TcpStoreListener::Source_Name(d.source));
  };
  EXPECT_EQ(dial("0.0.0.0:29400", "store.svc:80", "x:1"),
            "store.svc:80 ADVERTISED");
  EXPECT_EQ(dial("127.0.0.1:4321", "", "cohortd:29500"),
            "127.0.0.1:4321 BOUND");
  EXPECT_EQ(dial("[::1]:4321", "", "cohortd:29500"), "[::1]:4321 BOUND");
  // A wildcard bind: the host the caller dialed, in each form gRPC gives.
  EXPECT_EQ(dial("0.0.0.0:29400", "", "cohortd.ns.svc:29500"),
            "cohortd.ns.svc:29400 CALLER_HOST");
  EXPECT_EQ(dial("[::]:29400", "", "[fd00::7]:29500"),
            "[fd00::7]:29400 CALLER_HOST");
  EXPECT_EQ(dial(":29400", "", "10.0.0.3:29500,10.0.0.4:29500"),
            "10.0.0.3:29400 CALLER_HOST");
  EXPECT_EQ(dial("0.0.0.0:29400", "", "fd00::7"),
            "[fd00::7]:29400 CALLER_HOST");
  EXPECT_EQ(dial("0.0.0.0:29400", "", "cohortd"), "cohortd:29400 CALLER_HOST");
  // Nothing usable in the authority: the hostname.
  for (absl::string_view authority :
       {"", "0.0.0.0:29500", "[::]:29500", "a b:1", "x\n:1", "[::1"}) {
    EXPECT_EQ(dial("0.0.0.0:29400", "", authority), "node7:29400 HOSTNAME")
        << authority;
  }
}

TEST(CheckDialAddressTest, AcceptsHostPortAndSaysWhatIsWrong) {
  for (absl::string_view good :
       {"cohortd.ns.svc:29400", "10.0.0.3:1", "[fd00::1]:65535", "h_1:80"}) {
    EXPECT_TRUE(CheckDialAddress("--f", good).ok()) << good;
  }
  const auto why = [](absl::string_view address) {
    return std::string(CheckDialAddress("--f", address).message());
  };
  EXPECT_THAT(why("cohortd"), HasSubstr("no port"));
  EXPECT_THAT(why("cohortd:0"), HasSubstr("from 1 to 65535"));
  EXPECT_THAT(why("cohortd:65536"), HasSubstr("from 1 to 65535"));
  EXPECT_THAT(why("cohortd:+80"), HasSubstr("from 1 to 65535"));
  EXPECT_THAT(why(":29400"), HasSubstr("no host"));
  EXPECT_THAT(why("fd00::1:29400"), HasSubstr("in brackets"));
  EXPECT_THAT(why("a/b:29400"), HasSubstr("character"));
  EXPECT_THAT(why("0.0.0.0:29400"), HasSubstr("every interface"));
  EXPECT_THAT(why("[::]:29400"), HasSubstr("every interface"));
  EXPECT_THAT(why("x:y"), HasSubstr("--f: \"x:y\" is not a HOST:PORT"));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckDialAddress("--f", "x")));
}

TEST(NewServerIdTest, ThirtyTwoHexDigitsEachTimeNew) {
  const std::string a = NewServerId();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a, NewServerId());
}

class InfoServerTest : public ::testing::Test {
 protected:
  absl::StatusOr<std::unique_ptr<CohortServer>> Start(ServerOptions options) {
    options.listen = "127.0.0.1:0";
    return CohortServer::Start(
        std::make_unique<store::KvStore>(store::NewMemoryEngine()), options);
  }

  // GetServerInfo on `server`, dialed as `target`, with `token` if any.
  grpc::Status Get(const CohortServer& server, v1::ServerInfo* info,
                   const std::string& token = "",
                   const std::string& target = "") {
    auto stub = v1::Info::NewStub(grpc::CreateChannel(
        target.empty() ? absl::StrCat("127.0.0.1:", server.port()) : target,
        grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    return stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), info);
  }
};

TEST_F(InfoServerTest, ReportsVersionEngineIdAndTheBoundListener) {
  ServerOptions options;
  options.engine = "memory";
  options.tcpstore_listen = "127.0.0.1:0";
  auto server = Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  v1::ServerInfo info;
  ASSERT_TRUE(Get(**server, &info).ok());
  EXPECT_EQ(info.version(), kCohortVersion);
  EXPECT_EQ(info.engine(), "memory");
  EXPECT_EQ(info.server_id(), (*server)->server_id());
  ASSERT_TRUE(info.has_tcpstore());
  const std::string bound =
      absl::StrCat("127.0.0.1:", (*server)->tcpstore_port());
  EXPECT_EQ(info.tcpstore().address(), bound);
  EXPECT_EQ(info.tcpstore().source(), v1::TcpStoreListener::BOUND);
  EXPECT_EQ(info.tcpstore().bound(), bound);
  EXPECT_FALSE(info.tcpstore().token_required());

  // Another process's cohortd has an id of its own.
  auto other = Start(options);
  ASSERT_TRUE(other.ok()) << other.status();
  v1::ServerInfo other_info;
  ASSERT_TRUE(Get(**other, &other_info).ok());
  EXPECT_NE(other_info.server_id(), info.server_id());
}

TEST_F(InfoServerTest, AWildcardListenerIsReportedOnTheHostTheCallerDialed) {
  ServerOptions options;
  options.tcpstore_listen = "0.0.0.0:0";
  auto server = Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  v1::ServerInfo info;
  ASSERT_TRUE(
      Get(**server, &info, "", absl::StrCat("localhost:", (*server)->port()))
          .ok());
  EXPECT_EQ(info.tcpstore().address(),
            absl::StrCat("localhost:", (*server)->tcpstore_port()));
  EXPECT_EQ(info.tcpstore().source(), v1::TcpStoreListener::CALLER_HOST);
  EXPECT_EQ(info.tcpstore().bound(),
            absl::StrCat("0.0.0.0:", (*server)->tcpstore_port()));
}

TEST_F(InfoServerTest, AdvertisedAddressOffListenerAndBadFlags) {
  ServerOptions options;
  options.tcpstore_listen = "127.0.0.1:0";
  options.tcpstore_advertise = "tcpstore.example:29400";
  options.tcpstore_prefix = "jobs/";
  auto server = Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  v1::ServerInfo info;
  ASSERT_TRUE(Get(**server, &info).ok());
  EXPECT_EQ(info.tcpstore().address(), "tcpstore.example:29400");
  EXPECT_EQ(info.tcpstore().source(), v1::TcpStoreListener::ADVERTISED);
  EXPECT_EQ(info.tcpstore().prefix(), "jobs/");

  options.tcpstore_advertise = "0.0.0.0:29400";
  auto bad = Start(options);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(),
              HasSubstr("--tcpstore_advertise: \"0.0.0.0:29400\""));

  options.tcpstore_advertise = "tcpstore.example:29400";
  options.tcpstore_listen = "";
  bad = Start(options);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("but it is off"));

  options.tcpstore_advertise = "";
  auto off = Start(options);
  ASSERT_TRUE(off.ok()) << off.status();
  ASSERT_TRUE(Get(**off, &info).ok());
  EXPECT_FALSE(info.has_tcpstore());
}

TEST_F(InfoServerTest, WithAuthAnyValidTokenMayAsk) {
  const std::string tokens = absl::StrCat(::testing::TempDir(), "/info_tokens");
  std::ofstream(tokens) << "reader-token-0123456789 r job1/\n";
  ServerOptions options;
  options.tcpstore_listen = "127.0.0.1:0";
  options.auth_tokens = tokens;
  auto server = Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  v1::ServerInfo info;
  EXPECT_EQ(Get(**server, &info).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Get(**server, &info, "not-a-token-0123456789").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_TRUE(Get(**server, &info, "reader-token-0123456789").ok());
  EXPECT_TRUE(info.tcpstore().token_required());
}

}  // namespace
}  // namespace cohort::server

// Where cohortrun sends its workers' torch stores, from what it was told and
// what cohortd answered; and the messages of a failed start-up check. The check
// against real cohortds runs in tests/integration/cohortrun_test.sh.
#include "worker/launch/torch_store.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"

namespace cohort {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

v1::ServerInfo Listener(const std::string& address,
                        v1::TcpStoreListener::Source source,
                        const std::string& prefix = "") {
  v1::ServerInfo info;
  info.mutable_tcpstore()->set_address(address);
  info.mutable_tcpstore()->set_source(source);
  info.mutable_tcpstore()->set_bound("0.0.0.0:29400");
  info.mutable_tcpstore()->set_prefix(prefix);
  return info;
}

TEST(LocateTorchStoreTest, TheFlagThenTheEnvironmentThenCohortd) {
  const v1::ServerInfo info =
      Listener("store.svc:29400", v1::TcpStoreListener::ADVERTISED, "p/");
  auto where = LocateTorchStore("a:1", "b:2", "c:29500", info);
  ASSERT_TRUE(where.ok());
  EXPECT_EQ(where->address, "a:1");
  EXPECT_EQ(where->source, "--tcpstore");
  EXPECT_EQ(where->listener_prefix, "p/");
  EXPECT_TRUE(where->overridden);

  where = LocateTorchStore("", "b:2", "c:29500", info);
  EXPECT_EQ(where->address, "b:2");
  EXPECT_EQ(where->source, "$COHORT_TCPSTORE");

  where = LocateTorchStore("", "", "c:29500", info);
  EXPECT_EQ(where->address, "store.svc:29400");
  EXPECT_FALSE(where->overridden);
  EXPECT_THAT(where->source,
              AllOf(HasSubstr("cohortd at c:29500, which advertises it"),
                    HasSubstr("--tcpstore_advertise")));
}

TEST(LocateTorchStoreTest, SaysHowCohortdChoseTheAddress) {
  auto source = [](v1::TcpStoreListener::Source s) {
    return LocateTorchStore("", "", "c:29500", Listener("h:29400", s))->source;
  };
  EXPECT_THAT(source(v1::TcpStoreListener::BOUND),
              HasSubstr("where its listener is bound"));
  EXPECT_THAT(source(v1::TcpStoreListener::CALLER_HOST),
              HasSubstr("on the host cohortrun dialed (it is bound to "
                        "0.0.0.0:29400)"));
  EXPECT_THAT(source(v1::TcpStoreListener::HOSTNAME),
              HasSubstr("on its hostname"));
}

TEST(LocateTorchStoreTest, NoListenerAnOldCohortdAndAnUnreachableOne) {
  auto where = LocateTorchStore("", "", "c:29500", v1::ServerInfo());
  ASSERT_TRUE(where.ok());
  EXPECT_EQ(where->address, "");
  EXPECT_THAT(where->source, HasSubstr("serves no TCPStore listener"));

  where = LocateTorchStore("", "", "c:29500",
                           absl::UnimplementedError("unknown service"));
  ASSERT_TRUE(where.ok());
  EXPECT_EQ(where->address, "c:29400");
  EXPECT_THAT(where->source, HasSubstr("too old to say"));

  where = LocateTorchStore("a:1", "", "c:29500",
                           absl::UnavailableError("connection refused"));
  ASSERT_FALSE(where.ok());
  EXPECT_THAT(where.status().message(),
              HasSubstr("asking cohortd at c:29500 where its TCPStore "
                        "listener is: connection refused"));
}

std::string ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
}

TEST(CheckTorchStoreTest, AFailureNamesTheAddressItsSourceWhyAndTheRemedy) {
  InProcessStore store;
  const std::string address = ClosedPort();
  auto checked = CheckTorchStore(
      store, {.address = address, .source = "--tcpstore", .overridden = true},
      {.run_id = "job"});
  ASSERT_FALSE(checked.ok());
  EXPECT_THAT(checked.status().message(),
              AllOf(HasSubstr(absl::StrCat("listener at ", address,
                                           " (from --tcpstore) failed")),
                    HasSubstr("refused: nothing listens"),
                    HasSubstr("Connection reset by peer"),
                    HasSubstr("fix --tcpstore")));
  // The check key did not stay behind.
  EXPECT_EQ(*store.NumKeys(), 0);

  checked = CheckTorchStore(
      store, {.address = address, .source = "cohortd at c:29500"},
      {.run_id = "job"});
  ASSERT_FALSE(checked.ok());
  EXPECT_THAT(checked.status().message(),
              HasSubstr("start cohortd with --tcpstore_advertise=HOST:PORT"));
}

}  // namespace
}  // namespace cohort

// TcpStoreClient against a real cohortd's TCPStore listener, in the 2.1
// dialect: every Store op, a wait cancelled with CANCEL_WAIT, the probe,
// the keys seen through gRPC, and riding through kill -9 and a restart on
// the same data dir and ports.
#include "client/tcpstore_client.h"

#include <signal.h>

#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/remote_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cohortd_process.h"

namespace cohort {
namespace {

using testing::CohortdProcess;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class TcpStoreCohortdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(
        ::testing::TempDir(), "/tcpstore-",
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    auto server = CohortdProcess::Start({"--data_dir=" + dir_});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::make_unique<CohortdProcess>(std::move(*server));
    ASSERT_GT(server_->tcpstore_port(), 0);
  }

  TcpStoreClientOptions Options(
      TcpStoreDialect dialect = TcpStoreDialect::kTorch21) {
    TcpStoreClientOptions options;
    options.address = absl::StrCat("127.0.0.1:", server_->tcpstore_port());
    options.dialect = dialect;
    options.connect_timeout = absl::Seconds(20);
    return options;
  }

  std::unique_ptr<TcpStoreClient> Client(TcpStoreClientOptions options) {
    auto client = TcpStoreClient::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  // Kills cohortd with SIGKILL and starts it again on the same data dir
  // and both ports.
  void KillAndRestart() {
    const int port = server_->port();
    const int tcpstore_port = server_->tcpstore_port();
    server_->Stop(SIGKILL);
    auto server = CohortdProcess::Start(
        {"--data_dir=" + dir_,
         absl::StrCat("--tcpstore_listen=127.0.0.1:", tcpstore_port)},
        port);
    ASSERT_TRUE(server.ok()) << server.status();
    *server_ = std::move(*server);
  }

  std::string dir_;
  std::unique_ptr<CohortdProcess> server_;
};

TEST_F(TcpStoreCohortdTest, EveryOpIn21) {
  auto store = Client(Options());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->dialect(), tcpstore::Dialect::kTorch21);
  ASSERT_TRUE(store->Set("a", "hello").ok());
  EXPECT_EQ(store->Get("a", absl::Seconds(5)).value_or("?"), "hello");
  EXPECT_EQ(store->Add("n", 5).value_or(-1), 5);
  EXPECT_EQ(store->Add("n", -7).value_or(-1), -2);
  EXPECT_EQ(store->Get("n", absl::Seconds(5)).value_or("?"), "-2");

  EXPECT_EQ(store->CompareSet("c", "", "one").value_or("?"), "one");
  EXPECT_EQ(store->CompareSet("missing", "exp", "des").value_or("?"), "exp");
  EXPECT_EQ(store->CompareSet("c", "one", "two").value_or("?"), "two");
  EXPECT_EQ(store->CompareSet("c", "zzz", "three").value_or("?"), "two");

  EXPECT_TRUE(store->Check({"a", "c"}).value_or(false));
  EXPECT_FALSE(store->Check({"a", "missing"}).value_or(true));
  const int64_t keys = store->NumKeys().value_or(-1);
  EXPECT_GE(keys, 3);  // a, n, c
  EXPECT_TRUE(store->DeleteKey("a").value_or(false));
  EXPECT_FALSE(store->DeleteKey("a").value_or(true));
  EXPECT_EQ(store->NumKeys().value_or(-1), keys - 1);

  ASSERT_TRUE(store->MultiSet({"m/1", "m/2", "m/3"}, {"x", "", "z"}).ok());
  EXPECT_THAT(store->MultiGet({"m/3", "m/1", "m/2"}, absl::Seconds(5))
                  .value_or(std::vector<std::string>{}),
              ElementsAre("z", "x", ""));
  ASSERT_TRUE(store->Append("m/1", "y").ok());
  ASSERT_TRUE(store->Append("new", "q").ok());
  EXPECT_EQ(store->Get("m/1", absl::Seconds(5)).value_or("?"), "xy");
  EXPECT_EQ(store->Get("new", absl::Seconds(5)).value_or("?"), "q");

  absl::StatusOr<KeyList> list = store->ListKeys("m/");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(list->keys, ElementsAre("m/1", "m/2", "m/3"));
  EXPECT_EQ(store->Watch("", 0, [](const WatchEvent&) {}).status().code(),
            absl::StatusCode::kUnimplemented);
}

TEST_F(TcpStoreCohortdTest, KeyPrefixIsAddedAndStripped) {
  TcpStoreClientOptions options = Options();
  options.key_prefix = "/";
  auto store = Client(options);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->MultiSet({"p/b", "p/a"}, {"2", "1"}).ok());
  auto bare = Client(Options());
  ASSERT_NE(bare, nullptr);
  ASSERT_TRUE(bare->Set("p/c", "not mine").ok());
  EXPECT_EQ(bare->Get("/p/a", absl::Seconds(5)).value_or("?"), "1");
  absl::StatusOr<KeyList> list = store->ListKeys("p/");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(list->keys, ElementsAre("p/a", "p/b"));
  // The same keys through cohortd's gRPC API.
  auto grpc = RemoteStore::Connect({.address = server_->address()});
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  EXPECT_EQ((*grpc)->Get("/p/b", absl::Seconds(5)).value_or("?"), "2");
}

TEST_F(TcpStoreCohortdTest, WaitTimeoutCancelsAndKeepsTheConnection) {
  auto store = Client(Options());
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Set("a", "1").ok());
  const absl::Time t0 = absl::Now();
  absl::Status s = store->Wait({"a", "b"}, absl::Milliseconds(300));
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(s.message(),
            "wait for keys [a, b] timed out after 300ms; "
            "missing: b");
  absl::StatusOr<std::string> got = store->Get("b", absl::Milliseconds(50));
  EXPECT_THAT(got.status().message(), HasSubstr("missing: b"));
  // The cancelled wait left the connection in step: a later wait is woken.
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(200));
    auto other = Client(Options());
    ASSERT_NE(other, nullptr);
    ASSERT_TRUE(other->Set("b", "2").ok());
  });
  EXPECT_EQ(store->Get("b", absl::Seconds(10)).value_or("?"), "2");
  setter.join();
}

TEST_F(TcpStoreCohortdTest, ProbeIsAnsweredAs113) {
  auto store = Client(Options(TcpStoreDialect::kProbe));
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->dialect(), tcpstore::Dialect::kTorch113);
  ASSERT_TRUE(store->MultiSet({"k1", "k2"}, {"1", "2"}).ok());
  EXPECT_THAT(store->MultiGet({"k2", "k1"}, absl::Seconds(5))
                  .value_or(std::vector<std::string>{}),
              ElementsAre("2", "1"));
  ASSERT_TRUE(store->Append("k1", "1").ok());
  // Both dialects see one store.
  auto store21 = Client(Options());
  ASSERT_NE(store21, nullptr);
  EXPECT_EQ(store21->Get("k1", absl::Seconds(5)).value_or("?"), "11");
}

TEST_F(TcpStoreCohortdTest, RidesThroughKill9AndRestart) {
  auto store = Client(Options());
  auto waiter = Client(Options());
  ASSERT_NE(store, nullptr);
  ASSERT_NE(waiter, nullptr);
  ASSERT_TRUE(store->Set("before", "kept").ok());
  EXPECT_EQ(store->Add("count", 3).value_or(-1), 3);

  // Blocked in WAIT when cohortd dies; must wait again once it is back.
  absl::StatusOr<std::string> late;
  std::thread blocked([&] { late = waiter->Get("late", absl::Seconds(60)); });
  absl::SleepFor(absl::Milliseconds(300));
  KillAndRestart();

  // Add is not retried, but the restart's closed connection is noticed
  // before anything is sent, so it reconnects first.
  EXPECT_EQ(store->Add("count", 1).value_or(-1), 4);
  EXPECT_EQ(store->Get("before", absl::Seconds(5)).value_or("?"), "kept");
  ASSERT_TRUE(store->Set("late", "after restart").ok());
  blocked.join();
  EXPECT_EQ(late.value_or(late.status().ToString()), "after restart");

  // A call made while cohortd is down completes once it is back.
  const int port = server_->port();
  const int tcpstore_port = server_->tcpstore_port();
  server_->Stop(SIGKILL);
  absl::Status set_while_down;
  std::thread writer([&] { set_while_down = store->Set("down", "1"); });
  absl::SleepFor(absl::Milliseconds(500));
  auto server = CohortdProcess::Start(
      {"--data_dir=" + dir_,
       absl::StrCat("--tcpstore_listen=127.0.0.1:", tcpstore_port)},
      port);
  ASSERT_TRUE(server.ok()) << server.status();
  *server_ = std::move(*server);
  writer.join();
  EXPECT_TRUE(set_while_down.ok()) << set_while_down;
  // Acknowledged, so durable: it survives another kill -9.
  KillAndRestart();
  EXPECT_EQ(store->Get("down", absl::Seconds(5)).value_or("?"), "1");
}

}  // namespace
}  // namespace cohort

// RemoteStore against an in-process cohortd: the c10d semantics over the
// wire, blocking across clients, watches, errors and draining.
#include "client/remote_store.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/cohort_server.h"
#include "store/kv_engine.h"

namespace cohort {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class RemoteStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = server::CohortServer::Start(
        std::make_unique<store::KvStore>(store::NewMemoryEngine()),
        {.listen = "127.0.0.1:0"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    client_ = NewClient();
  }

  std::unique_ptr<RemoteStore> NewClient(int max_attempts = 5) {
    RemoteStoreOptions options;
    options.address = absl::StrCat("127.0.0.1:", server_->port());
    options.connect_timeout = absl::Seconds(5);
    options.max_attempts = max_attempts;
    auto store = RemoteStore::Connect(options);
    EXPECT_TRUE(store.ok()) << store.status();
    return std::move(*store);
  }

  std::unique_ptr<server::CohortServer> server_;
  std::unique_ptr<RemoteStore> client_;
};

TEST_F(RemoteStoreTest, C10dSemanticsOverTheWire) {
  ASSERT_TRUE(client_->Set("k", "v").ok());
  EXPECT_EQ(*client_->Get("k"), "v");
  EXPECT_EQ(*client_->Add("n", 5), 5);
  EXPECT_EQ(*client_->Add("n", 2), 7);
  EXPECT_EQ(*client_->Get("n"), "7");
  EXPECT_EQ(*client_->CompareSet("c", "", "first"), "first");
  EXPECT_EQ(*client_->CompareSet("d", "guess", "x"), "guess");
  EXPECT_EQ(*client_->CompareSet("c", "first", "second"), "second");
  EXPECT_EQ(*client_->CompareSet("c", "stale", "third"), "second");
  EXPECT_TRUE(*client_->Check({"k", "n", "c"}));
  EXPECT_FALSE(*client_->Check({"k", "d"}));
  EXPECT_EQ(*client_->NumKeys(), 3);
  ASSERT_TRUE(client_->MultiSet({"m1", "m2"}, {"a", "b"}).ok());
  EXPECT_THAT(*client_->MultiGet({"m2", "m1"}), ElementsAre("b", "a"));
  ASSERT_TRUE(client_->Append("m1", "+").ok());
  EXPECT_EQ(*client_->Get("m1"), "a+");
  EXPECT_TRUE(*client_->DeleteKey("m1"));
  EXPECT_FALSE(*client_->DeleteKey("m1"));
  EXPECT_THAT(client_->ListKeys("m")->keys, ElementsAre("m2"));
  EXPECT_TRUE(client_->Wait({"k", "n"}, absl::Seconds(1)).ok());
}

TEST_F(RemoteStoreTest, ListKeysFollowsPages) {
  std::vector<std::string> keys, values;
  for (int i = 0; i < 25000; ++i) {
    keys.push_back(absl::StrCat("p/", 100000 + i));
    values.push_back("v");
  }
  ASSERT_TRUE(client_->MultiSet(keys, values).ok());
  absl::StatusOr<KeyList> list = client_->ListKeys("p/");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->keys, keys);
}

TEST_F(RemoteStoreTest, BlockedGetIsReleasedBySetFromAnotherClient) {
  absl::Notification got;
  absl::StatusOr<std::string> value;
  std::thread getter([&] {
    value = client_->Get("late", absl::Seconds(30));
    got.Notify();
  });
  EXPECT_FALSE(got.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  std::unique_ptr<RemoteStore> other = NewClient();
  ASSERT_TRUE(other->Set("late", "hello").ok());
  EXPECT_TRUE(got.WaitForNotificationWithTimeout(absl::Seconds(10)));
  getter.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "hello");
}

TEST_F(RemoteStoreTest, TimeoutsNameTheMissingKeys) {
  absl::StatusOr<std::string> v =
      client_->Get("absent", absl::Milliseconds(100));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(v.status().message(), HasSubstr("\"absent\""));

  ASSERT_TRUE(client_->Set("here", "1").ok());
  absl::Status w =
      client_->Wait({"here", "gone1", "gone2"}, absl::Milliseconds(100));
  EXPECT_EQ(w.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(w.message(), HasSubstr("2 of 3 keys"));
  EXPECT_THAT(w.message(), HasSubstr("\"gone1\", \"gone2\""));

  client_->SetTimeout(absl::Milliseconds(100));
  EXPECT_THAT(client_->MultiGet({"here", "nope"}).status().message(),
              HasSubstr("\"nope\""));
}

TEST_F(RemoteStoreTest, EightClientsAddExactly) {
  constexpr int kClients = 8, kAdds = 1000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&] {
      std::unique_ptr<RemoteStore> mine = NewClient();
      for (int i = 0; i < kAdds; ++i) ASSERT_TRUE(mine->Add("total", 1).ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(*client_->Get("total"), absl::StrCat(kClients * kAdds));
}

TEST_F(RemoteStoreTest, BadInputIsInvalidArgumentAndServingContinues) {
  auto expect_invalid = [](absl::Status s, absl::string_view needle) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(needle));
  };
  expect_invalid(client_->Set("", "v"), "must not be empty");
  expect_invalid(client_->Set(std::string(4097, 'k'), "v"), "max_key_bytes");
  expect_invalid(client_->Set("k", std::string((8 << 20) + 1, 'v')),
                 "max_value_bytes");
  std::vector<std::string> many((128 << 10) + 1, "k");
  expect_invalid(client_->Check(many).status(), "max_keys_per_call");
  expect_invalid(client_->MultiSet({"a", "b"}, {"1"}), "2 keys but 1 values");
  expect_invalid(client_->Get("", absl::Seconds(1)).status(),
                 "must not be empty");
  ASSERT_TRUE(client_->Set("k", "still serving").ok());
  EXPECT_EQ(*client_->Get("k"), "still serving");
}

// cohortd's own records (rendezvous runs, group members) are under
// "/cohort/": clients read, list and watch them, but every write is
// PERMISSION_DENIED naming the namespace, and changes nothing.
TEST_F(RemoteStoreTest, WritesToCohortdsReservedNamespaceAreDenied) {
  const std::string run = "/cohort/runs/job";
  ASSERT_TRUE(server_->store().Set(run, "record").ok());
  auto expect_denied = [](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(s.message(),
                HasSubstr("is in cohortd's reserved namespace \"/cohort/\": "
                          "its coordination records are written only by "
                          "cohortd; use the Rendezvous and Membership RPCs"));
  };
  expect_denied(client_->Set(run, "mine"));
  expect_denied(client_->Set("/cohort/new", "mine"));
  expect_denied(client_->Add(run, 1).status());
  expect_denied(client_->CompareSet(run, "record", "mine").status());
  expect_denied(client_->Append(run, "+"));
  expect_denied(client_->DeleteKey(run).status());
  expect_denied(client_->MultiSet({"free", run}, {"1", "2"}));

  EXPECT_EQ(*client_->Get(run), "record");
  EXPECT_TRUE(*client_->Check({run}));
  EXPECT_THAT(client_->ListKeys("/cohort/")->keys, ElementsAre(run));
  EXPECT_FALSE(*client_->Check({"free"}));
  EXPECT_FALSE(*client_->Check({"/cohort/new"}));
  // Keys that only look alike are the user's.
  EXPECT_TRUE(client_->Set("cohort/runs/job", "mine").ok());
  EXPECT_TRUE(client_->Set("/cohorts", "mine").ok());
}

TEST_F(RemoteStoreTest, NegativeTimeoutIsRejected) {
  auto channel = grpc::CreateChannel(client_->address(),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Store::NewStub(channel);
  grpc::ClientContext ctx;
  v1::GetRequest req;
  req.set_key("k");
  req.set_timeout_ms(-5);
  v1::GetResponse resp;
  grpc::Status s = stub->Get(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("timeout_ms"));
}

TEST_F(RemoteStoreTest, ClientDeadlineEndsABlockedGet) {
  auto channel = grpc::CreateChannel(client_->address(),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Store::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(200));
  v1::GetRequest req;
  req.set_key("never");
  // The server-side timeout outlasts the test: only the client's deadline
  // can end the call (the server's would name the key it waited for).
  req.set_timeout_ms(10 * 60 * 1000);
  v1::GetResponse resp;
  grpc::Status s = stub->Get(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s.error_message(), ::testing::Not(HasSubstr("never")));
  // The abandoned waiter is gone: a later set completes nothing stale and
  // the server keeps answering.
  ASSERT_TRUE(client_->Set("never", "x").ok());
  EXPECT_EQ(*client_->Get("never"), "x");
}

TEST_F(RemoteStoreTest, WatchDeliversChangesAndResumes) {
  absl::Mutex mu;
  std::vector<std::string> seen;
  auto watch = client_->Watch("job/", 0, [&](const WatchEvent& e) {
    absl::MutexLock l(&mu);
    seen.push_back(
        absl::StrCat(e.type == WatchEvent::Type::kPut ? "put " : "del ", e.key,
                     "=", e.value));
  });
  ASSERT_TRUE(watch.ok());
  ASSERT_TRUE(client_->Set("job/a", "1").ok());
  ASSERT_TRUE(client_->Set("other", "x").ok());
  ASSERT_TRUE(client_->DeleteKey("job/a").ok());
  {
    absl::MutexLock l(&mu);
    mu.AwaitWithTimeout(
        absl::Condition(
            +[](std::vector<std::string>* s) { return s->size() >= 2; }, &seen),
        absl::Seconds(5));
    EXPECT_THAT(seen, ElementsAre("put job/a=1", "del job/a="));
  }
  (*watch)->Cancel();
  EXPECT_TRUE((*watch)->Wait().ok());

  // A new watch from an old revision replays history.
  KeyList list = *client_->ListKeys("job/");
  ASSERT_TRUE(client_->Set("job/b", "2").ok());
  std::vector<std::string> replayed;
  absl::Notification got;
  auto resumed =
      client_->Watch("job/", list.revision + 1, [&](const WatchEvent& e) {
        replayed.push_back(e.key);
        got.Notify();
      });
  ASSERT_TRUE(resumed.ok());
  ASSERT_TRUE(got.WaitForNotificationWithTimeout(absl::Seconds(5)));
  (*resumed)->Cancel();
  EXPECT_THAT(replayed, ElementsAre("job/b"));
}

TEST_F(RemoteStoreTest, WatchFromForgottenRevisionFailsClearly) {
  server_.reset();
  auto server = server::CohortServer::Start(
      std::make_unique<store::KvStore>(store::NewMemoryEngine(),
                                       store::StoreLimits{.history_events = 2}),
      {.listen = "127.0.0.1:0"});
  ASSERT_TRUE(server.ok());
  server_ = std::move(*server);
  client_ = NewClient();
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(client_->Set("k", "v").ok());
  auto watch = client_->Watch("", 1, [](const WatchEvent&) {});
  EXPECT_EQ(watch.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(watch.status().message(), HasSubstr("list the keys"));
}

TEST_F(RemoteStoreTest, DrainEndsBlockedCallsWithUnavailable) {
  std::unique_ptr<RemoteStore> once = NewClient(/*max_attempts=*/1);
  absl::Notification done;
  absl::Status status;
  std::thread waiter([&] {
    status = once->Wait({"never"}, absl::Minutes(10));
    done.Notify();
  });
  // Drain once the wait is blocked in the store (not while it is on its way).
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (server_->store().stats().waiters == 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(server_->store().stats().waiters, 1u)
      << "the wait never reached the store";
  ASSERT_TRUE(server_->Drain(absl::Seconds(1)).ok());
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  waiter.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr("shutting down"));
}

}  // namespace
}  // namespace cohort

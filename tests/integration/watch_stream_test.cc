// Watch streams against a real cohortd process: ResumingStream carries a
// RemoteStore watch across a kill -9 and restart with no event lost or
// repeated, and the server cuts off a watcher that stops reading once it
// falls --watch_buffer_bytes behind, while it serves everyone else.
#include <signal.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/remote_store.h"
#include "cohort/v1/store.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/testing/cohortd_process.h"

namespace cohort {
namespace {

using testing::CohortdProcess;

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name, "-", getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

std::unique_ptr<RemoteStore> Connect(const CohortdProcess& cohortd) {
  RemoteStoreOptions options;
  options.address = cohortd.address();
  options.connect_timeout = absl::Seconds(20);
  auto store = RemoteStore::Connect(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(*store);
}

TEST(WatchStreamTest, AWatchResumesAcrossAKillAndRestartWithNoGapOrRepeat) {
  const std::string data = TempDir("resume");
  auto first = CohortdProcess::Start({"--data_dir=" + data});
  ASSERT_TRUE(first.ok()) << first.status();
  const int port = first->port();
  std::unique_ptr<RemoteStore> writer = Connect(*first);
  std::unique_ptr<RemoteStore> watcher = Connect(*first);

  absl::Mutex mu;
  std::vector<std::string> seen;
  auto watch = watcher->Watch("w/", 0, [&](const WatchEvent& e) {
    absl::MutexLock lock(&mu);
    seen.push_back(e.value);
  });
  ASSERT_TRUE(watch.ok()) << watch.status();
  auto seen_at_least = [&](size_t n) {
    absl::MutexLock lock(&mu);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return seen.size() >= n;
    };
    return mu.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
  };

  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(writer->Set(absl::StrCat("w/", i), absl::StrCat(i)).ok());
  }
  ASSERT_TRUE(seen_at_least(10));
  EXPECT_EQ(first->Stop(SIGKILL) & 0x7f, SIGKILL);

  auto second = CohortdProcess::Start({"--data_dir=" + data}, port);
  ASSERT_TRUE(second.ok()) << second.status();
  for (int i = 10; i < 20; ++i) {
    ASSERT_TRUE(writer->Set(absl::StrCat("w/", i), absl::StrCat(i)).ok());
  }
  ASSERT_TRUE(seen_at_least(20));
  (*watch)->Cancel();
  absl::MutexLock lock(&mu);
  ASSERT_EQ(seen.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(seen[i], absl::StrCat(i));
  std::filesystem::remove_all(data);
}

TEST(WatchStreamTest, AWatcherThatStopsReadingIsCutOffAndOthersAreServed) {
  constexpr int kBuffer = 1 << 20;
  auto cohortd = CohortdProcess::Start(
      {"--engine=memory", absl::StrCat("--watch_buffer_bytes=", kBuffer)});
  ASSERT_TRUE(cohortd.ok()) << cohortd.status();
  auto channel = grpc::CreateChannel(cohortd->address(),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Store::NewStub(channel);

  grpc::ClientContext context;
  // Without the cutoff the stream would stay open: fail, do not hang.
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  v1::WatchRequest request;
  request.set_prefix("big/");
  std::unique_ptr<grpc::ClientReader<v1::WatchResponse>> reader =
      stub->Watch(&context, request);
  v1::WatchResponse response;
  ASSERT_TRUE(reader->Read(&response));  // Registered: its first message.

  // Far more than HTTP/2's windows can absorb, with nobody reading.
  std::unique_ptr<RemoteStore> writer = Connect(*cohortd);
  const std::string value(1 << 20, 'v');
  for (int i = 0; i < 48; ++i) {
    ASSERT_TRUE(writer->Set(absl::StrCat("big/", i), value).ok());
  }
  // Others are served while the slow stream is cut off.
  ASSERT_TRUE(writer->Set("small", "1").ok());
  EXPECT_EQ(*writer->Get("small"), "1");

  int events = 0;
  while (reader->Read(&response)) events += response.events_size();
  grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  EXPECT_NE(status.error_message().find(
                absl::StrCat("fell more than ", kBuffer, " bytes behind")),
            std::string::npos)
      << status.error_message();
  EXPECT_LT(events, 48);
}

}  // namespace
}  // namespace cohort

// Quotas per token (issue 24, finding 3 and "What to build" 3), against a
// real cohortd with tokens: a job's token over its watch streams, parked
// waits, keys waited on, or stored keys and bytes is refused with
// RESOURCE_EXHAUSTED naming the flag, while another job's token is served;
// what a call held comes back when it ends; deletes pass over quota; and the
// stored count holds across a restart.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cohort/v1/store.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/testing/cohortd_process.h"

namespace cohort {
namespace {

using testing::CohortdProcess;
using ::testing::HasSubstr;

constexpr char kAdmin[] = "admin-token-0123456789";
constexpr char kJob1[] = "job1-token-0123456789";
constexpr char kJob2[] = "job2-token-0123456789";

// How long a state the test waits for may take to arrive on a loaded
// machine; the test asserts the state, not the time.
constexpr absl::Duration kPatience = absl::Seconds(60);

std::unique_ptr<grpc::ClientContext> As(const std::string& token) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
  context->set_deadline(absl::ToChronoTime(absl::Now() + kPatience));
  return context;
}

// GET /metrics from 127.0.0.1:`port`; empty on failure.
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  struct sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request =
        "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(fd, request.data(), request.size()) ==
        static_cast<ssize_t>(request.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
    }
  }
  close(fd);
  return out;
}

// The value of the sample line that starts with `series` (name and labels
// as the exposition writes them), or -1.
double Sample(absl::string_view text, absl::string_view series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, series)) continue;
    absl::string_view rest = line.substr(series.size());
    if (rest.empty() || rest[0] != ' ') continue;
    double value = -1;
    if (absl::SimpleAtod(rest.substr(1), &value)) return value;
  }
  return -1;
}

class QuotaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           absl::StrCat("quota_test_", getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    tokens_ = (dir_ / "tokens").string();
    std::ofstream(tokens_) << kAdmin << " admin *\n"
                           << kJob1 << " rw job1/\n"
                           << kJob2 << " rw job2/\n";
  }

  void TearDown() override { std::filesystem::remove_all(dir_); }

  void Start(std::vector<std::string> flags) {
    flags.push_back("--auth_tokens=" + tokens_);
    flags.push_back("--tcpstore_listen=");
    flags.push_back("--metrics_listen=127.0.0.1:0");
    flags.push_back("--data_dir=" + (dir_ / "data").string());
    auto process = CohortdProcess::Start(flags);
    ASSERT_TRUE(process.ok()) << process.status();
    process_ = std::make_unique<CohortdProcess>(std::move(*process));
    channel_ = grpc::CreateChannel(process_->address(),
                                   grpc::InsecureChannelCredentials());
    store_ = v1::Store::NewStub(channel_);
    const std::string log = process_->Log();
    const std::string marker = "metrics on http://127.0.0.1:";
    const size_t at = log.find(marker);
    ASSERT_NE(at, std::string::npos) << log;
    const size_t begin = at + marker.size();
    ASSERT_TRUE(absl::SimpleAtoi(
        log.substr(begin, log.find('/', begin) - begin), &metrics_port_))
        << log;
  }

  // Waits until the sample `series` reads `value`.
  void AwaitSample(absl::string_view series, double value) {
    const absl::Time give_up = absl::Now() + kPatience;
    double now = -1;
    while (absl::Now() < give_up) {
      now = Sample(Scrape(metrics_port_), series);
      if (now == value) return;
      absl::SleepFor(absl::Milliseconds(20));
    }
    const std::string log = process_->Log();
    FAIL() << series << " stayed at " << now << ", not " << value
           << "; cohortd's log ends: "
           << log.substr(log.size() > 4000 ? log.size() - 4000 : 0);
  }

  grpc::Status Set(const std::string& token, const std::string& key,
                   const std::string& value) {
    v1::SetRequest request;
    request.set_key(key);
    request.set_value(value);
    v1::SetResponse response;
    return store_->Set(As(token).get(), request, &response);
  }

  grpc::Status Delete(const std::string& token, const std::string& key) {
    v1::DeleteRequest request;
    request.set_key(key);
    v1::DeleteResponse response;
    return store_->Delete(As(token).get(), request, &response);
  }

  std::filesystem::path dir_;
  std::string tokens_;
  std::unique_ptr<CohortdProcess> process_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Store::Stub> store_;
  int metrics_port_ = 0;
};

// A watch stream held open by the test.
struct OpenWatch {
  std::unique_ptr<grpc::ClientContext> context;
  std::unique_ptr<grpc::ClientReader<v1::WatchResponse>> reader;
};

// Opens a watch on `prefix` as `token`: the stream once its first message
// (the start revision) arrived, or the status it ended with.
grpc::Status OpenStream(v1::Store::Stub& store, const std::string& token,
                        const std::string& prefix, OpenWatch& watch) {
  watch.context = As(token);
  v1::WatchRequest request;
  request.set_prefix(prefix);
  watch.reader = store.Watch(watch.context.get(), request);
  v1::WatchResponse first;
  if (watch.reader->Read(&first)) return grpc::Status::OK;
  return watch.reader->Finish();
}

void Close(OpenWatch& watch) {
  watch.context->TryCancel();
  watch.reader->Finish().IgnoreError();
  watch.reader.reset();
}

TEST_F(QuotaTest, WatchStreamsOverTheQuotaAreRefusedForThatTokenOnly) {
  Start({"--engine=memory", "--quota_watch_streams=2"});
  OpenWatch a, b, over, other;
  ASSERT_TRUE(OpenStream(*store_, kJob1, "job1/", a).ok());
  ASSERT_TRUE(OpenStream(*store_, kJob1, "job1/x", b).ok());
  grpc::Status refused = OpenStream(*store_, kJob1, "job1/", over);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("--quota_watch_streams"));
  EXPECT_THAT(refused.error_message(), HasSubstr("2 in use"));
  // Another job's token is unaffected, and so is the admin.
  EXPECT_TRUE(OpenStream(*store_, kJob2, "job2/", other).ok());
  OpenWatch admin;
  EXPECT_TRUE(OpenStream(*store_, kAdmin, "", admin).ok());
  AwaitSample("cohort_quota_refused_total{quota=\"watch_streams\"}", 1);

  // A stream given back on close lets the token open one again (once
  // cohortd has seen the close).
  Close(a);
  AwaitSample("cohort_quota_used{quota=\"watch_streams\"}", 2);
  OpenWatch again;
  EXPECT_TRUE(OpenStream(*store_, kJob1, "job1/", again).ok());
  // The streams still open still deliver.
  ASSERT_TRUE(Set(kJob1, "job1/x1", "v").ok());
  v1::WatchResponse event;
  ASSERT_TRUE(b.reader->Read(&event));
  ASSERT_EQ(event.events_size(), 1);
  EXPECT_EQ(event.events(0).key(), "job1/x1");
  for (OpenWatch* w : {&b, &other, &admin, &again}) Close(*w);
}

// A Wait parked by the callback API; its status once it ends.
struct ParkedWait {
  std::unique_ptr<grpc::ClientContext> context;
  v1::WaitRequest request;
  v1::WaitResponse response;
  grpc::Status status;
  absl::Notification done;
};

void Park(v1::Store::Stub& store, const std::string& token,
          std::vector<std::string> keys, ParkedWait& wait) {
  wait.context = As(token);
  for (std::string& key : keys) wait.request.add_keys(std::move(key));
  store.async()->Wait(wait.context.get(), &wait.request, &wait.response,
                      [&wait](grpc::Status s) {
                        wait.status = std::move(s);
                        wait.done.Notify();
                      });
}

grpc::Status WaitNow(v1::Store::Stub& store, const std::string& token,
                     std::vector<std::string> keys) {
  ParkedWait wait;
  Park(store, token, std::move(keys), wait);
  wait.done.WaitForNotification();
  return wait.status;
}

TEST_F(QuotaTest, ParkedWaitsOverTheQuotaAreRefusedForThatTokenOnly) {
  Start({"--engine=memory", "--quota_waits=2", "--quota_waited_keys=5"});
  ParkedWait first, second;
  Park(*store_, kJob1, {"job1/a"}, first);
  Park(*store_, kJob1, {"job1/b", "job1/c"}, second);
  AwaitSample("cohort_quota_used{quota=\"waits\"}", 2);

  grpc::Status refused = WaitNow(*store_, kJob1, {"job1/d"});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("--quota_waits"));
  // A blocking Get is a parked wait too.
  v1::GetRequest get;
  get.set_key("job1/d");
  v1::GetResponse got;
  grpc::Status get_refused = store_->Get(As(kJob1).get(), get, &got);
  EXPECT_EQ(get_refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  AwaitSample("cohort_quota_refused_total{quota=\"waits\"}", 2);

  // Another job parks as many as its own quota lets it; past its keys
  // bound it is refused, naming that flag.
  ParkedWait other;
  Park(*store_, kJob2, {"job2/a", "job2/b", "job2/c", "job2/d", "job2/e"},
       other);
  AwaitSample("cohort_quota_used{quota=\"waits\"}", 3);
  grpc::Status too_many_keys = WaitNow(*store_, kJob2, {"job2/f"});
  EXPECT_EQ(too_many_keys.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(too_many_keys.error_message(), HasSubstr("--quota_waited_keys"));

  // A wait that ends, however it ends, gives its share back.
  ASSERT_TRUE(Set(kJob1, "job1/a", "1").ok());
  first.done.WaitForNotification();
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  second.context->TryCancel();
  second.done.WaitForNotification();
  // Given back once cohortd has ended both calls: job2's one wait is left.
  AwaitSample("cohort_quota_used{quota=\"waits\"}", 1);
  ASSERT_TRUE(Set(kJob1, "job1/d", "1").ok());
  EXPECT_TRUE(WaitNow(*store_, kJob1, {"job1/d"}).ok());
  ParkedWait third, fourth;
  Park(*store_, kJob1, {"job1/x"}, third);
  Park(*store_, kJob1, {"job1/y"}, fourth);
  AwaitSample("cohort_quota_used{quota=\"waits\"}", 3);
  AwaitSample("cohort_store_blocked_waiters", 3);
  other.context->TryCancel();
  third.context->TryCancel();
  fourth.context->TryCancel();
  for (ParkedWait* w : {&other, &third, &fourth}) {
    w->done.WaitForNotification();
    EXPECT_EQ(w->status.error_code(), grpc::StatusCode::CANCELLED)
        << w->status.error_message();
  }
}

TEST_F(QuotaTest, StoredKeysAndBytesAreBoundedPerTokenAndDeletesPass) {
  const std::vector<std::string> flags = {"--engine=rocksdb", "--quota_keys=4",
                                          "--quota_bytes=4096"};
  Start(flags);
  // The job's keys under its prefix and its runs' namespaces count
  // together.
  ASSERT_TRUE(Set(kJob1, "job1/a", "1").ok());
  ASSERT_TRUE(Set(kJob1, "runs/job1/b", "2").ok());
  ASSERT_TRUE(Set(kJob1, "/cohortrun/job1/c", "3").ok());
  ASSERT_TRUE(Set(kJob1, "job1/d", "4").ok());
  grpc::Status refused = Set(kJob1, "job1/e", "5");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("--quota_keys"));
  EXPECT_THAT(refused.error_message(), HasSubstr("hold 4 keys"));
  // Another job writes on; an admin's writes elsewhere are no job's.
  EXPECT_TRUE(Set(kJob2, "job2/a", "1").ok());
  EXPECT_TRUE(Set(kAdmin, "shared/a", "1").ok());
  grpc::Status big = Set(kJob2, "job2/big", std::string(5000, 'x'));
  EXPECT_EQ(big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(big.error_message(), HasSubstr("--quota_bytes"));
  // Deletes pass, and make room.
  ASSERT_TRUE(Delete(kJob1, "job1/a").ok());
  ASSERT_TRUE(Set(kJob1, "job1/e", "5").ok());
  AwaitSample("cohort_quota_refused_total{quota=\"keys\"}", 1);
  AwaitSample("cohort_quota_refused_total{quota=\"bytes\"}", 1);

  // The count is the store's: after a restart, the four keys still fill
  // job1's quota.
  ASSERT_EQ(process_->Stop(SIGTERM), 0) << process_->Log();
  Start(flags);
  grpc::Status still = Set(kJob1, "job1/f", "6");
  EXPECT_EQ(still.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(still.error_message(), HasSubstr("--quota_keys"));
  EXPECT_TRUE(Set(kJob2, "job2/b", "1").ok());
}

}  // namespace
}  // namespace cohort

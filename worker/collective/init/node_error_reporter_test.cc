// NodeErrorReporterFromEnv against a cohortd subprocess. Its own binary:
// it uses gRPC in the test process, and init_test forks ranks that must
// start gRPC afresh.
#include <cstdlib>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/membership_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cohortd_process.h"
#include "worker/collective/init/init.h"

namespace cohort {
namespace {

using ::testing::HasSubstr;

// What the NCCL watchdog calls under cohortrun: the failure reaches every
// node watching the run's group as an error of this node's member.
TEST(NodeErrorReporter, ReportsAsTheNodesMember) {
  auto server = testing::CohortdProcess::Start({"--engine=memory"});
  ASSERT_TRUE(server.ok()) << server.status();
  ConnectionOptions connection;
  connection.address = server->address();
  auto membership = MembershipClient::Connect(connection);
  ASSERT_TRUE(membership.ok()) << membership.status();
  MemberOptions agent;
  agent.group = "run7";
  agent.name = "node-a";
  auto member = (*membership)->JoinGroup(agent);
  ASSERT_TRUE(member.ok()) << member.status();
  absl::Mutex mu;
  std::vector<MemberEvent> errors;
  auto watch = (*membership)->Watch("run7", [&](const MemberEvent& e) {
    absl::MutexLock lock(&mu);
    if (e.type == MemberEvent::Type::kErrorReported) errors.push_back(e);
  });
  ASSERT_TRUE(watch.ok()) << watch.status();

  unsetenv("COHORT_MEMBER_NAME");
  setenv("COHORT_ADDR", server->address().c_str(), 1);
  setenv("COHORT_MEMBER_GROUP", "run7", 1);
  setenv("COHORT_MEMBER_INCARNATION",
         absl::StrCat((*member)->incarnation()).c_str(), 1);
  // Not under cohortrun (no member name): nothing to report to.
  EXPECT_EQ(NodeErrorReporterFromEnv(3), nullptr);
  setenv("COHORT_MEMBER_NAME", "node-a", 1);
  auto reporter = NodeErrorReporterFromEnv(3);
  ASSERT_NE(reporter, nullptr);
  reporter(absl::UnavailableError("NCCL: remote process exited"));
  reporter(absl::InternalError("a second report is dropped"));

  absl::MutexLock lock(&mu);
  ASSERT_TRUE(mu.AwaitWithTimeout(
      absl::Condition(
          +[](std::vector<MemberEvent>* e) { return !e->empty(); }, &errors),
      absl::Seconds(20)));
  EXPECT_EQ(errors[0].member.name, "node-a");
  EXPECT_THAT(errors[0].message, HasSubstr("rank 3: UNAVAILABLE: NCCL: "
                                           "remote process exited"));
  mu.Unlock();
  absl::SleepFor(absl::Milliseconds(300));
  mu.Lock();
  EXPECT_EQ(errors.size(), 1u);
  for (const char* name : {"COHORT_ADDR", "COHORT_MEMBER_GROUP",
                           "COHORT_MEMBER_NAME", "COHORT_MEMBER_INCARNATION"}) {
    unsetenv(name);
  }
}

}  // namespace
}  // namespace cohort

#include "server/auth/auth.h"

#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/kv_engine.h"

namespace cohort::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kAdmin[] = "admin-token-0123456789";
constexpr char kJob[] = "job1-token-0123456789";
constexpr char kReader[] = "reader-token-0123456789";

using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;

Metadata Bearer(const std::string& value) {
  static std::vector<std::unique_ptr<std::string>> keep;
  keep.push_back(std::make_unique<std::string>("Bearer " + value));
  return {{"authorization", *keep.back()}};
}

TEST(CoversTest, PrefixRootAndLauncherNamespace) {
  EXPECT_TRUE(Covers("job1/", "job1/a"));
  EXPECT_TRUE(Covers("job1/", "job1"));  // The run named by the prefix.
  EXPECT_FALSE(Covers("job1/", "job10"));
  EXPECT_FALSE(Covers("job1/", "job2/a"));
  EXPECT_TRUE(Covers("*", "anything"));
  EXPECT_TRUE(CoversKey("job1/", "/cohortrun/job1/0/rank0"));
  EXPECT_FALSE(CoversKey("job1/", "/cohortrun/job2/0/rank0"));
  EXPECT_TRUE(CoversKey("job1/", "runs/job1/0/pg"));
  EXPECT_FALSE(CoversKey("job1/", "runs/job10/0/pg"));
  EXPECT_FALSE(CoversKey("job1/", "/cohort/runs/job1"));
}

TEST(CheckAccessTest, NamesThePrefixAndTheRole) {
  Grant rw{.role = v1::READ_WRITE, .prefix = "job1/", .source = "file line 2"};
  Grant r{.role = v1::READ, .prefix = "job1/", .source = "file line 3"};
  EXPECT_TRUE(CheckAccess(rw, "key", "job1/x", Access::kWrite).ok());
  absl::Status outside = CheckAccess(rw, "key", "job2/x", Access::kRead);
  EXPECT_EQ(outside.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(outside.message(), HasSubstr("prefix 'job1/'"));
  EXPECT_THAT(outside.message(), HasSubstr("job2/x"));
  EXPECT_TRUE(CheckAccess(r, "key", "job1/x", Access::kRead).ok());
  absl::Status write = CheckAccess(r, "run", "job1/x", Access::kWrite);
  EXPECT_EQ(write.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(write.message(), HasSubstr("read-only"));
}

TEST(NarrowPrefixTest, CutsToTheGrantOrRefuses) {
  Grant g{.role = v1::READ, .prefix = "job1/", .source = "s"};
  EXPECT_EQ(*NarrowPrefix(g, ""), "job1/");
  EXPECT_EQ(*NarrowPrefix(g, "job1/sub/"), "job1/sub/");
  EXPECT_EQ(*NarrowPrefix(g, "/cohortrun/"), "/cohortrun/job1/");
  EXPECT_EQ(NarrowPrefix(g, "job2/").status().code(),
            absl::StatusCode::kPermissionDenied);
  Grant admin{.role = v1::ADMIN, .prefix = "*", .source = "s"};
  EXPECT_EQ(*NarrowPrefix(admin, ""), "");
  EXPECT_EQ(*NarrowPrefix(admin, "job1"), "job1");
}

// A prefix is a set of keys: whatever shape it has, what it is narrowed to
// matches no key of a sibling job named as the grant's name extended
// (jobA/ beside jobAB/, jobA.other/, runs/jobAB/, /cohortrun/jobAB/).
TEST(NarrowPrefixTest, NeverReachesSiblingsNamedAsThePrefixExtended) {
  const Grant g{.role = v1::READ, .prefix = "jobA/", .source = "s"};
  const std::vector<std::string> siblings = {
      "jobAB/secret", "jobA.other/secret", "jobA", "runs/jobAB/0/pg",
      "runs/jobA.x/k", "/cohortrun/jobAB/0/rank0", "/cohortrun/jobA"};
  const std::vector<std::string> own = {"jobA/k", "jobA/sub/k", "runs/jobA/0/pg",
                                        "/cohortrun/jobA/0/rank0"};
  struct Shape {
    std::string requested;
    std::string narrowed;  // Empty: refused.
  };
  for (const Shape& shape : std::vector<Shape>{
           {"", "jobA/"},
           {"j", "jobA/"},
           {"job", "jobA/"},                    // One character short...
           {"jobA", "jobA/"},                   // ... the bare name...
           {"jobA/", "jobA/"},                  // ... the grant exactly...
           {"jobA/sub/", "jobA/sub/"},          // ... longer.
           {"jobAB", ""},                       // Across the '/' boundary.
           {"jobA.", ""},
           {"runs/", "runs/jobA/"},
           {"runs/jobA", "runs/jobA/"},
           {"runs/jobA/", "runs/jobA/"},
           {"runs/jobAB", ""},
           {"/cohortrun/jobA", "/cohortrun/jobA/"},
           {"/cohortrun/jobA/0/", "/cohortrun/jobA/0/"},
           {"/cohortrun/jobAB/", ""},
           {"/cohort/", ""},
       }) {
    absl::StatusOr<std::string> narrowed = NarrowPrefix(g, shape.requested);
    if (shape.narrowed.empty()) {
      EXPECT_EQ(narrowed.status().code(), absl::StatusCode::kPermissionDenied)
          << "'" << shape.requested << "' -> " << narrowed.value_or("?");
      continue;
    }
    ASSERT_TRUE(narrowed.ok()) << shape.requested << ": " << narrowed.status();
    EXPECT_EQ(*narrowed, shape.narrowed) << "'" << shape.requested << "'";
    for (const std::string& key : siblings) {
      EXPECT_FALSE(absl::StartsWith(key, *narrowed))
          << "'" << shape.requested << "' narrowed to '" << *narrowed
          << "' matches " << key;
    }
    bool reaches_own = false;
    for (const std::string& key : own) {
      reaches_own |= absl::StartsWith(key, *narrowed);
    }
    EXPECT_TRUE(reaches_own) << "'" << shape.requested << "'";
  }
}

TEST(ParseTokensFileTest, ParsesRolesCommentsAndBlankLines) {
  auto parsed = ParseTokensFile(
      absl::StrCat("# the cluster's tokens\n\n", kAdmin, " admin *\n", kJob,
                   "\trw job1/   # training job 1\n", kReader, " r job1/\n"),
      "tokens");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 3);
  EXPECT_EQ((*parsed)[0].grant.role, v1::ADMIN);
  EXPECT_EQ((*parsed)[1].grant.prefix, "job1/");
  EXPECT_EQ((*parsed)[1].grant.source, "file line 4");
  EXPECT_EQ((*parsed)[1].digest, TokenDigest(kJob));
  EXPECT_EQ((*parsed)[2].grant.role, v1::READ);
}

TEST(ParseTokensFileTest, RefusesBadLinesNamingThemWithoutTheToken) {
  struct Case {
    std::string text;
    std::string says;
  } cases[] = {
      {absl::StrCat(kJob, " rw\n"), "tokens:1: expected 3 fields"},
      {absl::StrCat(kJob, " owner job1/\n"), "unknown role 'owner'"},
      {"short rw job1/\n", "16 to 4096 printable"},
      {absl::StrCat(kAdmin, " admin job1/\n"), "admin's prefix must be *"},
      {absl::StrCat(kJob, " rw *\n"), "needs a prefix"},
      {absl::StrCat("\n", kJob, " rw a/\n", kJob, " r b/\n"),
       "tokens:3: the same token as line 2"},
  };
  for (const Case& c : cases) {
    auto parsed = ParseTokensFile(c.text, "tokens");
    ASSERT_FALSE(parsed.ok()) << c.text;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr(c.says));
    EXPECT_THAT(parsed.status().message(), Not(HasSubstr(kJob)));
  }
}

class AuthenticatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = absl::StrCat(::testing::TempDir(), "/tokens-",
                         ::testing::UnitTest::GetInstance()
                             ->current_test_info()
                             ->name());
    Write(absl::StrCat(kAdmin, " admin *\n", kJob, " rw job1/\n"));
    store_ = std::make_unique<store::KvStore>(store::NewMemoryEngine());
    auto auth = Authenticator::Start(
        {.tokens_file = path_, .store = store_.get(),
         .log = [this](absl::string_view line) {
           logged_.emplace_back(line);
         }});
    ASSERT_TRUE(auth.ok()) << auth.status();
    auth_ = std::move(*auth);
  }
  void Write(const std::string& text) {
    std::ofstream(path_, std::ios::trunc) << text;
  }

  std::string path_;
  std::vector<std::string> logged_;
  std::unique_ptr<store::KvStore> store_;
  std::unique_ptr<Authenticator> auth_;
};

TEST_F(AuthenticatorTest, FileTokensAuthenticateOthersDoNot) {
  auto admin = auth_->Authenticate(Bearer(kAdmin));
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_TRUE(admin->admin());
  Metadata plain = {{"cohort-token", kJob}};
  auto job = auth_->Authenticate(plain);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->prefix, "job1/");

  EXPECT_EQ(auth_->Authenticate({}).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(auth_->Authenticate({}).status().message(),
              HasSubstr("COHORT_TOKEN"));
  auto unknown = auth_->Authenticate(Bearer("not-a-known-token-000"));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(unknown.status().message(), HasSubstr("unknown or revoked"));
  Metadata basic = {{"authorization", "Basic abc"}};
  EXPECT_THAT(auth_->Authenticate(basic).status().message(),
              HasSubstr("Bearer"));
  EXPECT_THAT(auth_->Authenticate(Bearer("x")).status().message(),
              HasSubstr("malformed"));
  AuthStats stats = auth_->stats();
  EXPECT_EQ(stats.authenticated, 2);
  EXPECT_EQ(stats.missing_token, 2);
  EXPECT_EQ(stats.unknown_token, 1);
  EXPECT_EQ(stats.malformed_token, 2);
}

TEST_F(AuthenticatorTest, ThousandsOfFailuresLogOncePerSecond) {
  const size_t before = logged_.size();
  for (int i = 0; i < 10000; ++i) {
    ASSERT_FALSE(auth_->Authenticate(Bearer("garbage-token-garbage")).ok());
  }
  EXPECT_EQ(auth_->stats().unknown_token, 10000);
  EXPECT_LE(logged_.size() - before, 3);
}

TEST_F(AuthenticatorTest, ReloadTakesNewTokensAndKeepsOldOnError) {
  Write(absl::StrCat(kAdmin, " admin *\n", kReader, " r job1/\n"));
  ASSERT_TRUE(auth_->Reload().ok());
  EXPECT_TRUE(auth_->Authenticate(Bearer(kReader)).ok());
  EXPECT_FALSE(auth_->Authenticate(Bearer(kJob)).ok());  // Removed.

  Write("broken line\n");
  absl::Status broken = auth_->Reload();
  EXPECT_EQ(broken.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(broken.message(), HasSubstr(":1:"));
  EXPECT_TRUE(auth_->Authenticate(Bearer(kReader)).ok());  // Still in force.
  EXPECT_EQ(auth_->stats().reload_failures, 1);
  // A broken file is not retried until it changes again.
  EXPECT_FALSE(auth_->ReloadIfChanged());
  EXPECT_EQ(auth_->stats().reload_failures, 1);
}

TEST_F(AuthenticatorTest, IssuedTokensAreScopedStoredHashedAndRevocable) {
  Grant admin = *auth_->Authenticate(Bearer(kAdmin));
  Grant job = *auth_->Authenticate(Bearer(kJob));

  v1::IssueTokenRequest wider;
  wider.set_role(v1::READ_WRITE);
  wider.set_prefix("job2/");
  EXPECT_EQ(auth_->Issue(job, wider).status().code(),
            absl::StatusCode::kPermissionDenied);
  v1::IssueTokenRequest as_admin;
  as_admin.set_role(v1::ADMIN);
  as_admin.set_prefix("*");
  EXPECT_EQ(auth_->Issue(job, as_admin).status().code(),
            absl::StatusCode::kPermissionDenied);

  v1::IssueTokenRequest narrower;
  narrower.set_role(v1::READ_WRITE);
  narrower.set_prefix("job1/run7/");
  narrower.set_description("workers of run 7");
  auto issued = auth_->Issue(job, narrower);
  ASSERT_TRUE(issued.ok()) << issued.status();
  EXPECT_EQ(issued->id(), TokenDigest(issued->token()));
  // Only the digest is stored.
  auto stored = store_->TryGet(absl::StrCat(kIssuedTokensPrefix, issued->id()));
  ASSERT_TRUE(stored.ok() && stored->has_value());
  EXPECT_THAT(**stored, Not(HasSubstr(issued->token())));

  auto grant = auth_->Authenticate(Bearer(issued->token()));
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_EQ(grant->prefix, "job1/run7/");
  EXPECT_EQ(auth_->List(job)->tokens_size(), 1);
  EXPECT_EQ(auth_->List(admin)->tokens(0).description(), "workers of run 7");

  ASSERT_TRUE(auth_->Revoke(job, issued->id()).ok());
  EXPECT_EQ(auth_->Authenticate(Bearer(issued->token())).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth_->Revoke(admin, issued->id()).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(auth_->Revoke(admin, "zz").code(),
            absl::StatusCode::kInvalidArgument);
}

// Whatever bytes a caller puts in a prefix, no log line gains a line break
// or another control byte from them: control bytes are refused outright,
// and the rest reaches the log escaped.
TEST_F(AuthenticatorTest, HostilePrefixesForgeNoLogLines) {
  Grant admin = *auth_->Authenticate(Bearer(kAdmin));
  Grant job = *auth_->Authenticate(Bearer(kJob));
  for (const std::string& prefix :
       {std::string("job1/\nauth: forged line"), std::string("job1/\rx"),
        std::string("job1/\x1b[31mred"), std::string("job1/\x7f"),
        std::string("job1/\0nul", 9)}) {
    v1::IssueTokenRequest request;
    request.set_role(v1::READ_WRITE);
    request.set_prefix(prefix);
    for (const Grant& caller : {admin, job}) {
      absl::StatusOr<v1::IssueTokenResponse> issued =
          auth_->Issue(caller, request);
      EXPECT_EQ(issued.status().code(), absl::StatusCode::kInvalidArgument)
          << absl::CHexEscape(prefix);
      EXPECT_THAT(issued.status().message(), HasSubstr("control bytes"));
    }
  }
  // Outside the job's prefix (logged as a denial) and issued by the admin
  // (logged as an issue), with bytes that are not plain ASCII.
  v1::IssueTokenRequest outside;
  outside.set_role(v1::READ);
  outside.set_prefix("job2/\xc3\xa9\"'");  // "job2/é\"'"
  EXPECT_EQ(auth_->Issue(job, outside).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(auth_->Issue(admin, outside).ok());
  bool denial = false, issue = false;
  for (const std::string& line : logged_) {
    for (char c : line) {
      EXPECT_FALSE(static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
          << "log line '" << absl::CHexEscape(line) << "'";
    }
    EXPECT_EQ(line.find("\xc3"), std::string::npos) << absl::CHexEscape(line);
    denial |= absl::StrContains(line, "denied") &&
              absl::StrContains(line, "job2/\\xc3\\xa9");
    issue |= absl::StrContains(line, "issued token") &&
             absl::StrContains(line, "job2/\\xc3\\xa9");
  }
  EXPECT_TRUE(denial) << "no denial logged: " << absl::StrJoin(logged_, " | ");
  EXPECT_TRUE(issue) << "no issue logged";
}

// An issued token lives only while every token above it does: revoking or
// removing an issuer ends what it issued, at once and transitively; a token
// revokes only itself and what lies below it; every issued token expires.
TEST_F(AuthenticatorTest, IssuedTokensLiveOnlyWhileTheirIssuersDo) {
  Grant job = *auth_->Authenticate(Bearer(kJob));
  auto issue = [&](const Grant& by, const std::string& prefix,
                   int64_t ttl_ms = 0) {
    v1::IssueTokenRequest request;
    request.set_role(v1::READ_WRITE);
    request.set_prefix(prefix);
    request.set_ttl_ms(ttl_ms);
    absl::StatusOr<v1::IssueTokenResponse> issued = auth_->Issue(by, request);
    EXPECT_TRUE(issued.ok()) << issued.status();
    return issued.value_or(v1::IssueTokenResponse());
  };
  auto grant = [&](const v1::IssueTokenResponse& t) {
    return auth_->Authenticate(Bearer(t.token()));
  };
  // job (file) -> child -> grandchild; child -> sibling of grandchild.
  const int64_t before = absl::ToUnixMillis(absl::Now());
  const v1::IssueTokenResponse child = issue(job, "job1/");
  const int64_t after = absl::ToUnixMillis(absl::Now());
  const Grant child_grant = *grant(child);
  const v1::IssueTokenResponse grandchild = issue(child_grant, "job1/run1/");
  const v1::IssueTokenResponse other = issue(child_grant, "job1/run1/");
  const Grant grandchild_grant = *grant(grandchild);

  // No token revokes its issuer or a sibling, whatever their prefixes.
  for (const std::string& id : {child.id(), other.id()}) {
    absl::Status s = auth_->Revoke(grandchild_grant, id);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(s.message(), HasSubstr("only revoke itself"));
  }
  EXPECT_TRUE(grant(child).ok());

  // Every issued token expires, within --max_token_ttl (30 days here) of
  // its issue and never after its issuer.
  const int64_t month = int64_t{30} * 24 * 3600 * 1000;
  EXPECT_GE(child.expires_unix_ms(), before + month);  // ttl 0: the maximum.
  EXPECT_LE(child.expires_unix_ms(), after + month);
  EXPECT_EQ(child_grant.expires_unix_ms, child.expires_unix_ms());
  EXPECT_LE(grandchild.expires_unix_ms(), child.expires_unix_ms());
  const v1::IssueTokenResponse short_lived = issue(job, "job1/x/", 60000);
  const Grant short_grant = *grant(short_lived);
  EXPECT_LE(issue(short_grant, "job1/x/", month).expires_unix_ms(),
            short_lived.expires_unix_ms());
  for (int64_t ttl : {int64_t{-1}, month + 1,
                      std::numeric_limits<int64_t>::max()}) {
    v1::IssueTokenRequest request;
    request.set_role(v1::READ);
    request.set_prefix("job1/");
    request.set_ttl_ms(ttl);
    absl::StatusOr<v1::IssueTokenResponse> refused = auth_->Issue(job, request);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
        << ttl;
    EXPECT_THAT(refused.status().message(), HasSubstr("--max_token_ttl"));
  }

  // Revoking the child ends the grandchild and its sibling too.
  ASSERT_TRUE(auth_->Revoke(job, child.id()).ok());
  for (const v1::IssueTokenResponse& t : {child, grandchild, other}) {
    absl::StatusOr<Grant> g = grant(t);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kUnauthenticated) << t.id();
  }
  EXPECT_THAT(grant(grandchild).status().message(),
              HasSubstr("revoked or removed"));

  // Removing a file token from the file ends what it issued.
  const v1::IssueTokenResponse from_file = issue(job, "job1/y/");
  const v1::IssueTokenResponse below = issue(*grant(from_file), "job1/y/z/");
  ASSERT_TRUE(grant(below).ok());
  Write(absl::StrCat(kAdmin, " admin *\n"));
  ASSERT_TRUE(auth_->Reload().ok());
  EXPECT_EQ(grant(from_file).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(grant(below).status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(AuthenticatorTest, IssuedTokensExpire) {
  Grant admin = *auth_->Authenticate(Bearer(kAdmin));
  v1::IssueTokenRequest request;
  request.set_role(v1::READ);
  request.set_prefix("job3/");
  request.set_ttl_ms(1);
  auto issued = auth_->Issue(admin, request);
  ASSERT_TRUE(issued.ok());
  absl::SleepFor(absl::Milliseconds(5));
  auto expired = auth_->Authenticate(Bearer(issued->token()));
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(expired.status().message(), HasSubstr("expired at"));
  EXPECT_EQ(auth_->stats().expired_token, 1);
  request.set_ttl_ms(-1);
  EXPECT_EQ(auth_->Issue(admin, request).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// An engine that records the keys read and the prefixes listed, to prove
// what a call touches.
class RecordingEngine : public store::KvEngine {
 public:
  explicit RecordingEngine(std::vector<std::string>* reads)
      : inner_(store::NewMemoryEngine()), reads_(reads) {}

  absl::string_view name() const override { return inner_->name(); }
  absl::StatusOr<std::optional<std::string>> Get(
      absl::string_view key) const override {
    reads_->push_back(absl::StrCat("get ", key));
    return inner_->Get(key);
  }
  bool Contains(absl::string_view key) const override {
    return inner_->Contains(key);
  }
  std::unique_ptr<PreparedRead> PrepareRead(
      std::vector<std::string> keys) const override {
    return inner_->PrepareRead(std::move(keys));
  }
  absl::Status Apply(absl::Span<const store::Mutation> mutations,
                     int64_t revision) override {
    return inner_->Apply(mutations, revision);
  }
  int64_t revision() const override { return inner_->revision(); }
  int64_t NumKeys() const override { return inner_->NumKeys(); }
  absl::StatusOr<int64_t> CountKeys(absl::string_view prefix) const override {
    return inner_->CountKeys(prefix);
  }
  absl::StatusOr<std::vector<std::string>> ListKeys(
      absl::string_view prefix, absl::string_view start_after,
      size_t limit) const override {
    reads_->push_back(absl::StrCat("list ", prefix));
    return inner_->ListKeys(prefix, start_after, limit);
  }
  absl::Status Flush() override { return inner_->Flush(); }

 private:
  std::unique_ptr<store::KvEngine> inner_;
  std::vector<std::string>* const reads_;
};

constexpr char kJob2[] = "job2-token-0123456789";

// Issued tokens' lifecycle, on a clock of the test's own: sweeping, limits
// on issuing, and ending what was revoked.
class TokenLifecycleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = absl::StrCat(
        ::testing::TempDir(), "/lifecycle-",
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    Write(absl::StrCat(kAdmin, " admin *\n", kJob, " rw job1/\n", kJob2,
                       " rw job2/\n"));
  }
  void Start(IssueLimits limits = {}) {
    store_ = std::make_unique<store::KvStore>(
        std::make_unique<RecordingEngine>(&reads_));
    auto auth = Authenticator::Start(
        {.tokens_file = path_,
         .store = store_.get(),
         .log = [this](absl::string_view line) { logged_.emplace_back(line); },
         .issue_limits = limits,
         .now = [this] { return now_; }});
    ASSERT_TRUE(auth.ok()) << auth.status();
    auth_ = std::move(*auth);
  }
  void Write(const std::string& text) {
    std::ofstream(path_, std::ios::trunc) << text;
  }
  Grant FileGrant(const char* token) {
    absl::StatusOr<Grant> grant = auth_->Authenticate(Bearer(token));
    EXPECT_TRUE(grant.ok()) << grant.status();
    return grant.value_or(Grant());
  }
  absl::StatusOr<v1::IssueTokenResponse> TryIssue(const Grant& by,
                                                  const std::string& prefix,
                                                  int64_t ttl_ms = 3600000) {
    v1::IssueTokenRequest request;
    request.set_role(v1::READ_WRITE);
    request.set_prefix(prefix);
    request.set_ttl_ms(ttl_ms);
    return auth_->Issue(by, request);
  }
  v1::IssueTokenResponse Issue(const Grant& by, const std::string& prefix,
                               int64_t ttl_ms = 3600000) {
    absl::StatusOr<v1::IssueTokenResponse> issued =
        TryIssue(by, prefix, ttl_ms);
    EXPECT_TRUE(issued.ok()) << issued.status();
    return issued.value_or(v1::IssueTokenResponse());
  }
  Grant GrantOf(const v1::IssueTokenResponse& issued) {
    absl::StatusOr<Grant> grant = auth_->Authenticate(Bearer(issued.token()));
    EXPECT_TRUE(grant.ok()) << grant.status();
    return grant.value_or(Grant());
  }
  std::vector<std::string> Keys(absl::string_view prefix) {
    absl::StatusOr<store::ListResult> listed = store_->ListKeys(prefix, 0, "");
    EXPECT_TRUE(listed.ok()) << listed.status();
    return listed.ok() ? listed->keys : std::vector<std::string>();
  }
  std::vector<std::string> Listed(const Grant& caller) {
    absl::StatusOr<v1::ListTokensResponse> listed = auth_->List(caller);
    EXPECT_TRUE(listed.ok()) << listed.status();
    std::vector<std::string> ids;
    if (listed.ok()) {
      for (const v1::TokenInfo& t : listed->tokens()) ids.push_back(t.id());
    }
    return ids;
  }

  std::string path_;
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
  std::vector<std::string> reads_;
  std::vector<std::string> logged_;
  std::unique_ptr<store::KvStore> store_;
  std::unique_ptr<Authenticator> auth_;
};

TEST_F(TokenLifecycleTest, SweepDeletesExpiredAndOrphanedRecordsOnly) {
  Start();
  const Grant job = FileGrant(kJob);
  const Grant job2 = FileGrant(kJob2);
  const v1::IssueTokenResponse live = Issue(job, "job1/live/");
  const v1::IssueTokenResponse live_child =
      Issue(GrantOf(live), "job1/live/child/");
  const v1::IssueTokenResponse short_lived = Issue(job, "job1/short/", 1000);
  // Orphaned by a revocation: its issuer's record goes with the revocation,
  // its own stays until the sweep.
  const v1::IssueTokenResponse parent = Issue(job, "job1/parent/");
  const v1::IssueTokenResponse orphan =
      Issue(GrantOf(parent), "job1/parent/o/");
  ASSERT_TRUE(auth_->Revoke(job, parent.id()).ok());
  // Orphaned by the removal of its file token.
  const v1::IssueTokenResponse from_removed = Issue(job2, "job2/x/");
  Write(absl::StrCat(kAdmin, " admin *\n", kJob, " rw job1/\n"));
  ASSERT_TRUE(auth_->Reload().ok());
  now_ += absl::Seconds(2);  // short_lived expires.

  // Dead records are never listed, swept or not.
  const Grant admin = FileGrant(kAdmin);
  EXPECT_THAT(Listed(admin),
              ::testing::UnorderedElementsAre(live.id(), live_child.id()));
  EXPECT_THAT(Listed(job),
              ::testing::UnorderedElementsAre(live.id(), live_child.id()));

  absl::StatusOr<size_t> swept = auth_->Sweep();
  ASSERT_TRUE(swept.ok()) << swept.status();
  EXPECT_EQ(*swept, 3u);  // short_lived, orphan, from_removed.
  std::vector<std::string> records = Keys(kIssuedTokensPrefix);
  EXPECT_THAT(records, ::testing::UnorderedElementsAre(
                           absl::StrCat(kIssuedTokensPrefix, live.id()),
                           absl::StrCat(kIssuedTokensPrefix, live_child.id())));
  // Their index entries went with them.
  EXPECT_EQ(Keys(kIssuedTokensIndexPrefix).size(), 2u);
  EXPECT_TRUE(auth_->Authenticate(Bearer(live.token())).ok());
  EXPECT_TRUE(auth_->Authenticate(Bearer(live_child.token())).ok());
  EXPECT_EQ(auth_->stats().swept_tokens, 3u);
  EXPECT_EQ(auth_->stats().issued_tokens, 2u);
  EXPECT_EQ(*auth_->Sweep(), 0u);

  // Expiry reaches the records below too (they expire with their issuer).
  now_ += absl::Hours(2);
  EXPECT_EQ(*auth_->Sweep(), 2u);
  EXPECT_TRUE(Keys("/cohort/auth/").empty());
  EXPECT_EQ(auth_->stats().issued_tokens, 0u);
}

TEST_F(TokenLifecycleTest, IssuingIsLimitedPerTenantNamingTheFlags) {
  Start({.rate = 1, .burst = 3, .max_live = 5});
  const Grant job = FileGrant(kJob);
  const Grant admin = FileGrant(kAdmin);
  // The job and the tokens under it share one bucket.
  const v1::IssueTokenResponse child = Issue(job, "job1/c/");
  const Grant child_grant = GrantOf(child);
  Issue(child_grant, "job1/c/1/");
  Issue(job, "job1/2/");
  for (const Grant* by : {&job, &child_grant}) {
    absl::StatusOr<v1::IssueTokenResponse> refused = TryIssue(*by, "job1/c/x/");
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(refused.status().message(), HasSubstr("--token_issue_rate"));
    EXPECT_THAT(refused.status().message(), HasSubstr("--token_issue_burst"));
  }
  // Another tenant is unaffected.
  for (int i = 0; i < 3; ++i) Issue(admin, "job3/");
  // Six tokens issued at one instant, two refusals: one log line.
  size_t issue_lines = 0;
  for (const std::string& line : logged_) {
    issue_lines += absl::StrContains(line, "issued token") ||
                   absl::StrContains(line, "refused to issue");
  }
  EXPECT_EQ(issue_lines, 1u) << absl::StrJoin(logged_, "\n");

  // The bucket refills at the rate.
  now_ += absl::Seconds(1);
  Issue(job, "job1/3/");
  EXPECT_EQ(TryIssue(job, "job1/4/").status().code(),
            absl::StatusCode::kResourceExhausted);
  now_ += absl::Seconds(10);
  Issue(job, "job1/4/");  // Five alive under job1's file token.
  absl::StatusOr<v1::IssueTokenResponse> full = TryIssue(job, "job1/5/");
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.status().message(), HasSubstr("--max_issued_tokens"));
  EXPECT_THAT(full.status().message(), HasSubstr("5 issued tokens alive"));
  // Revoking one makes room, as does the sweep of expired ones.
  ASSERT_TRUE(auth_->Revoke(job, child.id()).ok());
  Issue(job, "job1/5/");  // child's own child is dead but not swept yet.
  EXPECT_EQ(TryIssue(job, "job1/6/").status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(auth_->Sweep().ok());
  Issue(job, "job1/6/");
  AuthStats stats = auth_->stats();
  EXPECT_EQ(stats.issue_rate_limited, 3u);
  EXPECT_EQ(stats.issue_over_max, 2u);
}

// finding 4: one tenant's thousands of tokens cost another's ListTokens
// nothing, since it reads only the records within its prefix.
TEST_F(TokenLifecycleTest, ListTokensReadsOnlyTheCallersRecords) {
  Start();
  const Grant admin = FileGrant(kAdmin);
  const Grant job = FileGrant(kJob);
  std::vector<std::string> others;
  for (int i = 0; i < 200; ++i) {
    others.push_back(Issue(admin, absl::StrCat("job2/w", i, "/")).id());
  }
  others.push_back(Issue(admin, "job10/").id());  // job1 extended.
  const std::string own = Issue(job, "job1/w/").id();
  reads_.clear();
  EXPECT_THAT(Listed(job), ::testing::ElementsAre(own));
  for (const std::string& read : reads_) {
    for (const std::string& id : others) {
      EXPECT_FALSE(absl::StrContains(read, id)) << read;
    }
    EXPECT_NE(read, absl::StrCat("list ", kIssuedTokensPrefix));
  }
  EXPECT_EQ(Listed(admin).size(), others.size() + 1);
}

// An issued token holds only while its whole chain does; calls in flight
// learn at once (WatchGrant), and Recheck costs nothing while nothing
// changed.
TEST_F(TokenLifecycleTest, RevocationReachesCallsInFlight) {
  Start();
  const Grant job = FileGrant(kJob);
  const v1::IssueTokenResponse child = Issue(job, "job1/c/");
  const Grant grandchild = GrantOf(Issue(GrantOf(child), "job1/c/g/"));
  const Grant other = GrantOf(Issue(job, "job1/o/"));
  reads_.clear();
  for (const Grant* g : {&job, &grandchild, &other}) {
    EXPECT_TRUE(auth_->Recheck(*g).ok());
  }
  EXPECT_THAT(reads_, ::testing::IsEmpty());  // Nothing changed: no reads.

  std::map<std::string, std::vector<absl::Status>> ended;
  auto watch = [&](const std::string& name, const Grant& grant) {
    absl::StatusOr<Authenticator::GrantWatchId> id = auth_->WatchGrant(
        grant, [&ended, name](absl::Status s) { ended[name].push_back(s); });
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or(0);
  };
  watch("job", job);
  watch("grandchild", grandchild);
  watch("other", other);
  auth_->ForgetGrant(watch("forgotten", grandchild));

  // Revoking the child ends what it issued, before Revoke returns.
  ASSERT_TRUE(auth_->Revoke(job, child.id()).ok());
  ASSERT_EQ(ended["grandchild"].size(), 1u);
  EXPECT_EQ(ended["grandchild"][0].code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(ended["grandchild"][0].message(), HasSubstr("revoked"));
  EXPECT_TRUE(ended["job"].empty());
  EXPECT_TRUE(ended["other"].empty());
  EXPECT_TRUE(ended["forgotten"].empty());
  EXPECT_EQ(auth_->Recheck(grandchild).code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(auth_->Recheck(other).ok());
  EXPECT_EQ(auth_->WatchGrant(grandchild, [](absl::Status) {}).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth_->stats().calls_ended, 1u);

  // Expiry needs only the clock.
  const Grant short_lived = GrantOf(Issue(job, "job1/s/", 1000));
  now_ += absl::Seconds(2);
  EXPECT_THAT(auth_->CheckExpiry(short_lived).message(),
              HasSubstr("expired at"));
  EXPECT_EQ(auth_->Recheck(short_lived).code(),
            absl::StatusCode::kUnauthenticated);

  // Removing the job's file token ends its calls and those of what it
  // issued; once.
  Write(absl::StrCat(kAdmin, " admin *\n"));
  ASSERT_TRUE(auth_->Reload().ok());
  ASSERT_EQ(ended["job"].size(), 1u);
  EXPECT_THAT(ended["job"][0].message(), HasSubstr("removed from the tokens"));
  ASSERT_EQ(ended["other"].size(), 1u);
  EXPECT_THAT(ended["other"][0].message(), HasSubstr("revoked or removed"));
  EXPECT_EQ(ended["grandchild"].size(), 1u);
  ASSERT_TRUE(auth_->Reload().ok());
  EXPECT_EQ(ended["job"].size(), 1u);
}

// Another replica's revocation over a shared store deletes the record
// without this Authenticator: the epoch moves all the same, so Recheck
// reads the record again.
TEST_F(TokenLifecycleTest, ARecordDeletedInTheStoreEndsTheGrant) {
  Start();
  const Grant job = FileGrant(kJob);
  const v1::IssueTokenResponse issued = Issue(job, "job1/x/");
  const Grant grant = GrantOf(issued);
  ASSERT_TRUE(auth_->Recheck(grant).ok());
  ASSERT_TRUE(
      store_->Delete(absl::StrCat(kIssuedTokensPrefix, issued.id())).ok());
  absl::Status s = auth_->Recheck(grant);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(s.message(), HasSubstr("revoked"));
}

}  // namespace
}  // namespace cohort::server

#include "server/auth/auth.h"

#include <openssl/evp.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "proto/auth/roles.h"

namespace cohort::server {
namespace {

constexpr size_t kMinTokenBytes = 16;
constexpr size_t kMaxTokenBytes = 4096;
constexpr size_t kMaxDescriptionBytes = 256;
// Issued tokens between a token and the file token at the root of its
// issuers (cohortrun's worker tokens sit at 1 or 2).
constexpr size_t kMaxIssuerChain = 16;
// An issued token's prefix, hex-encoded, is part of its index key, which
// must stay within the store's 4 KiB keys.
constexpr size_t kMaxIssuedPrefixBytes = 1024;
// Records read per page by Sweep and List.
constexpr size_t kRecordsPerPage = 1000;

// Causes, for the per-cause log limiters.
enum Cause {
  kMissing,
  kMalformed,
  kUnknown,
  kExpired,
  kDenied,
  kReload,
  kIssue,
  kRevoke,
  kSweep,
  kNumCauses
};

std::string FormatMs(int64_t ms) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixMillis(ms),
                          absl::UTCTimeZone());
}

// Tokens are printable ASCII without blanks, so they survive a file line,
// an HTTP header and a shell variable alike.
bool IsTokenText(absl::string_view token) {
  if (token.size() < kMinTokenBytes || token.size() > kMaxTokenBytes) {
    return false;
  }
  for (char c : token) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

absl::Status CheckGrantShape(v1::Role role, absl::string_view prefix) {
  if (role == v1::ADMIN) {
    if (prefix != "*") {
      return absl::InvalidArgumentError(
          absl::StrCat("an admin's prefix must be *, got '",
                       absl::CHexEscape(prefix.substr(0, 256)), "'"));
    }
    return absl::OkStatus();
  }
  if (role != v1::READ && role != v1::READ_WRITE) {
    return absl::InvalidArgumentError("role must be r, rw or admin");
  }
  if (prefix.empty() || prefix == "*") {
    return absl::InvalidArgumentError(
        "a r or rw token needs a prefix (not empty, not *): the key prefix "
        "of the job it is for, e.g. job1/");
  }
  // A prefix names a job: control bytes have no place in it, and would
  // reach every log line and message that names the token's prefix.
  for (char c : prefix) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("a token's prefix may not hold control bytes; got '",
                       absl::CHexEscape(prefix.substr(0, 256)), "'"));
    }
  }
  return absl::OkStatus();
}

std::string IndexKey(absl::string_view prefix, absl::string_view id) {
  return absl::StrCat(kIssuedTokensIndexPrefix, absl::BytesToHexString(prefix),
                      "/", id);
}

// Whom issuing by `caller` is charged to: the file token heading its chain
// (the token itself for a file token), or for a token recorded before
// issuers were kept, the token itself.
std::string TenantOf(const Grant& caller) {
  return caller.root_digest.empty() ? caller.digest : caller.root_digest;
}

}  // namespace

bool Covers(absl::string_view prefix, absl::string_view name) {
  if (prefix == "*") return true;
  if (absl::StartsWith(name, prefix)) return true;
  return !prefix.empty() && prefix.back() == '/' &&
         name == prefix.substr(0, prefix.size() - 1);
}

bool CoversKey(absl::string_view prefix, absl::string_view key) {
  if (Covers(prefix, key)) return true;
  for (absl::string_view space : kRunNamespaces) {
    if (absl::StartsWith(key, space) &&
        Covers(prefix, key.substr(space.size()))) {
      return true;
    }
  }
  return false;
}

absl::Status CheckAccess(const Grant& grant, absl::string_view what,
                         absl::string_view name, Access access) {
  const bool covered = what == "key" ? CoversKey(grant.prefix, name)
                                     : Covers(grant.prefix, name);
  if (!covered) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the token (", grant.source, ") grants only names under prefix '",
        grant.prefix, "'; ", what, " '", absl::CHexEscape(name.substr(0, 256)),
        "' is outside it"));
  }
  if (access == Access::kWrite && grant.role == v1::READ) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the token (", grant.source, ") is read-only under prefix '",
        grant.prefix, "'; writing ", what, " '",
        absl::CHexEscape(name.substr(0, 256)), "' needs a rw token"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> NarrowPrefix(const Grant& grant,
                                         absl::string_view requested) {
  if (grant.prefix == "*") return std::string(requested);
  // A prefix stands for every key that starts with it, so it is allowed
  // only under one of the grant's roots, whose every extension the grant
  // covers. CoversKey is for one key: it also takes the bare run name
  // ("job1" under "job1/"), and a listing or watch of "job1" would reach
  // "job10/..." and "job1.other/...".
  std::vector<std::string> roots = {grant.prefix};
  for (absl::string_view space : kRunNamespaces) {
    roots.push_back(absl::StrCat(space, grant.prefix));
  }
  for (const std::string& root : roots) {
    if (absl::StartsWith(requested, root)) return std::string(requested);
  }
  for (const std::string& root : roots) {
    if (absl::StartsWith(root, requested)) return root;
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "the token (", grant.source, ") grants only keys under '",
      absl::StrJoin(roots, "', '"), "'; prefix '",
      absl::CHexEscape(requested.substr(0, 256)), "' is outside them"));
}

std::string TokenDigest(absl::string_view token) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(token.data(), token.size(), digest, &length, EVP_sha256(),
             nullptr);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), length));
}

absl::StatusOr<std::vector<FileToken>> ParseTokensFile(absl::string_view text,
                                                       absl::string_view path) {
  std::vector<FileToken> tokens;
  absl::flat_hash_map<std::string, int> seen;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) {
      line = line.substr(0, hash);
    }
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", number, ": ", why,
                       " (lines are \"TOKEN ROLE PREFIX\", ROLE r, rw or "
                       "admin; admin's PREFIX is *)"));
    };
    if (fields.size() != 3) {
      return bad(absl::StrCat("expected 3 fields, found ", fields.size()));
    }
    if (!IsTokenText(fields[0])) {
      return bad(absl::StrCat("the token must be ", kMinTokenBytes, " to ",
                              kMaxTokenBytes,
                              " printable characters without blanks "
                              "(e.g. `openssl rand -hex 32`)"));
    }
    std::optional<v1::Role> parsed_role = auth::ParseRole(fields[1]);
    if (!parsed_role.has_value()) {
      return bad(absl::StrCat("unknown role '",
                              absl::CHexEscape(fields[1].substr(0, 32)), "'"));
    }
    const v1::Role role = *parsed_role;
    if (absl::Status s = CheckGrantShape(role, fields[2]); !s.ok()) {
      return bad(s.message());
    }
    FileToken token;
    token.digest = TokenDigest(fields[0]);
    auto [it, fresh] = seen.emplace(token.digest, number);
    if (!fresh) {
      return bad(absl::StrCat("the same token as line ", it->second));
    }
    token.grant = {.role = role,
                   .prefix = std::string(fields[2]),
                   .source = absl::StrCat("file line ", number)};
    tokens.push_back(std::move(token));
  }
  return tokens;
}

Authenticator::Authenticator(AuthenticatorOptions options)
    : options_(std::move(options)) {
  for (int i = 0; i < kNumCauses; ++i) {
    limiters_.emplace_back(options_.log, absl::Seconds(1), options_.now);
  }
}

Authenticator::~Authenticator() {
  {
    absl::MutexLock lock(&wake_mu_);
    stopping_ = true;
  }
  if (sweeper_.joinable()) sweeper_.join();
  if (uint64_t id = records_watch_.exchange(0); id != 0) {
    options_.store->CancelWatch(id);
  }
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Start(
    AuthenticatorOptions options) {
  if (options.tokens_file.empty()) {
    return absl::InvalidArgumentError("--auth_tokens needs a file");
  }
  std::unique_ptr<Authenticator> auth(new Authenticator(std::move(options)));
  if (absl::Status s = auth->Reload(); !s.ok()) return s;
  if (absl::Status s = auth->WatchRecords(); !s.ok()) return s;
  // Serving without it is safe (dead records authenticate nothing), so a
  // store error here is reported, not fatal; the next sweep retries.
  if (absl::StatusOr<size_t> swept = auth->Sweep(); !swept.ok()) {
    auth->LogLimited(kSweep, absl::StrCat("auth: sweeping issued tokens at "
                                          "start failed: ",
                                          swept.status().message()));
  }
  if (auth->options_.sweep_interval > absl::ZeroDuration()) {
    auth->sweeper_ = std::thread([a = auth.get()] { a->SweepLoop(); });
  }
  return auth;
}

absl::Status Authenticator::WatchRecords() {
  // Runs under the store's lock: it only bumps the epoch and wakes the
  // sweeping thread, which ends the calls (Changed reads the store).
  auto on_events = [this](std::vector<store::Event> events) {
    for (const store::Event& e : events) {
      if (e.type != store::Event::Type::kDelete) continue;
      epoch_.fetch_add(1);
      absl::MutexLock lock(&wake_mu_);
      deleted_elsewhere_ = true;
      return;
    }
  };
  absl::StatusOr<store::KvStore::WatchStart> start = options_.store->Watch(
      kIssuedTokensPrefix, 0, on_events, [](absl::Status) {});
  if (!start.ok()) return start.status();
  records_watch_ = start->id;
  return absl::OkStatus();
}

void Authenticator::SweepLoop() {
  absl::Time next = absl::Now() + options_.sweep_interval;
  while (true) {
    bool elsewhere = false;
    {
      absl::MutexLock lock(&wake_mu_);
      wake_mu_.AwaitWithDeadline(absl::Condition(this, &Authenticator::Woken),
                                 next);
      if (stopping_) return;
      elsewhere = deleted_elsewhere_;
      deleted_elsewhere_ = false;
    }
    if (elsewhere) Changed();
    if (absl::Now() < next) continue;
    if (absl::StatusOr<size_t> swept = Sweep(); !swept.ok()) {
      LogLimited(kSweep,
                 absl::StrCat("auth: sweeping issued tokens failed "
                              "(retried in ",
                              absl::FormatDuration(options_.sweep_interval),
                              "): ", swept.status().message()));
    }
    next = absl::Now() + options_.sweep_interval;
  }
}

absl::Status Authenticator::Reload() {
  const std::string& path = options_.tokens_file;
  struct stat st;
  std::ifstream in(path, std::ios::binary);
  absl::Status status;
  std::vector<FileToken> tokens;
  if (!in || stat(path.c_str(), &st) != 0) {
    status = absl::FailedPreconditionError(absl::StrCat(
        "cannot read the tokens file ", path, ": ", std::strerror(errno)));
  } else {
    std::stringstream text;
    text << in.rdbuf();
    absl::StatusOr<std::vector<FileToken>> parsed =
        ParseTokensFile(text.str(), path);
    if (parsed.ok()) {
      tokens = std::move(*parsed);
    } else {
      status = parsed.status();
    }
  }
  if (!status.ok()) {
    reload_failures_.fetch_add(1, std::memory_order_relaxed);
    {
      // Remember the file as seen, so a broken file is reported once, not
      // at every check until it is fixed.
      absl::MutexLock lock(&mu_);
      if (stat(path.c_str(), &st) == 0) {
        file_size_ = st.st_size;
        file_mtime_ns_ = st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
        file_inode_ = st.st_ino;
      }
    }
    LogLimited(kReload, absl::StrCat("auth: keeping the tokens in force: ",
                                     status.message()));
    return status;
  }
  size_t admins = 0;
  absl::flat_hash_map<std::string, Grant> table;
  for (FileToken& t : tokens) {
    admins += t.grant.admin();
    t.grant.digest = t.digest;
    t.grant.root_digest = t.digest;
    table.emplace(std::move(t.digest), std::move(t.grant));
  }
  const size_t count = table.size();
  {
    absl::MutexLock lock(&mu_);
    file_tokens_ = std::move(table);
    file_size_ = st.st_size;
    file_mtime_ns_ = st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    file_inode_ = st.st_ino;
  }
  reloads_.fetch_add(1, std::memory_order_relaxed);
  // A token gone from the file ends its calls in flight and what it issued.
  Changed();
  if (options_.log) {
    options_.log(absl::StrCat(
        "auth: loaded ", count, count == 1 ? " token" : " tokens", " (", admins,
        admins == 1 ? " admin" : " admins", ") from ", path,
        admins == 0 ? "; no admin token: nobody can issue tokens" : ""));
  }
  return absl::OkStatus();
}

bool Authenticator::ReloadIfChanged() {
  struct stat st;
  if (stat(options_.tokens_file.c_str(), &st) != 0) return false;
  {
    absl::MutexLock lock(&mu_);
    const int64_t mtime = st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    if (static_cast<uint64_t>(st.st_size) == file_size_ &&
        mtime == file_mtime_ns_ && st.st_ino == file_inode_) {
      return false;
    }
  }
  return Reload().ok();
}

void Authenticator::LogLimited(int cause, absl::string_view line) {
  absl::MutexLock lock(&log_mu_);
  limiters_[cause].Log(line);
}

void Authenticator::Fail(std::atomic<uint64_t>& counter, int cause,
                         absl::string_view line) {
  counter.fetch_add(1, std::memory_order_relaxed);
  LogLimited(cause, line);
}

absl::StatusOr<Grant> Authenticator::Authenticate(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
  absl::string_view token;
  bool found = false;
  for (absl::string_view header : {"authorization", "cohort-token"}) {
    auto it = metadata.find(grpc::string_ref(header.data(), header.size()));
    if (it == metadata.end()) continue;
    absl::string_view value(it->second.data(), it->second.size());
    if (header == "authorization") {
      if (!absl::StartsWithIgnoreCase(value, "Bearer ")) {
        Fail(malformed_, kMalformed,
             "auth: refused a call whose authorization header is not "
             "\"Bearer TOKEN\"");
        return absl::UnauthenticatedError(
            "the authorization metadata must be \"Bearer TOKEN\"");
      }
      value.remove_prefix(7);
    }
    token = absl::StripAsciiWhitespace(value);
    found = true;
    break;
  }
  if (!found) {
    Fail(missing_, kMissing, "auth: refused a call without a token");
    return absl::UnauthenticatedError(
        "cohortd requires a token: set COHORT_TOKEN (sent as metadata "
        "\"authorization: Bearer TOKEN\")");
  }
  return AuthenticateToken(token);
}

absl::StatusOr<Grant> Authenticator::AuthenticateToken(
    absl::string_view token) {
  if (!IsTokenText(token)) {
    Fail(malformed_, kMalformed,
         "auth: refused a call whose token is not a token (wrong length or "
         "characters)");
    return absl::UnauthenticatedError(absl::StrCat(
        "the token is malformed: tokens are ", kMinTokenBytes, " to ",
        kMaxTokenBytes, " printable characters without blanks"));
  }
  const std::string digest = TokenDigest(token);
  // Read before the checks: a change made during them makes the grant
  // stale for Recheck, never falsely fresh.
  const uint64_t epoch = epoch_.load();
  {
    absl::ReaderMutexLock lock(&mu_);
    if (auto it = file_tokens_.find(digest); it != file_tokens_.end()) {
      authenticated_.fetch_add(1, std::memory_order_relaxed);
      Grant grant = it->second;
      grant.epoch = epoch;
      return grant;
    }
  }
  absl::StatusOr<std::optional<std::string>> record =
      options_.store->TryGet(absl::StrCat(kIssuedTokensPrefix, digest));
  if (!record.ok()) return record.status();
  v1::TokenRecord parsed;
  if (!record->has_value() || !parsed.ParseFromString(**record)) {
    Fail(unknown_, kUnknown,
         absl::StrCat("auth: refused a call with an unknown or revoked token "
                      "(sha256 ",
                      digest.substr(0, 12), "...)"));
    return absl::UnauthenticatedError(
        "the token is not valid here (unknown or revoked)");
  }
  if (parsed.expires_unix_ms() != 0 && parsed.expires_unix_ms() <= NowMs()) {
    Fail(expired_, kExpired,
         absl::StrCat("auth: refused a call with token ", digest.substr(0, 12),
                      "..., expired at ", FormatMs(parsed.expires_unix_ms())));
    return absl::UnauthenticatedError(absl::StrCat(
        "the token expired at ", FormatMs(parsed.expires_unix_ms())));
  }
  absl::StatusOr<std::vector<std::string>> issuers = Issuers(parsed);
  if (!issuers.ok()) {
    Fail(unknown_, kUnknown,
         absl::StrCat("auth: refused a call with token ", digest.substr(0, 12),
                      "...: ", issuers.status().message()));
    return issuers.status();
  }
  authenticated_.fetch_add(1, std::memory_order_relaxed);
  return Grant{
      .role = parsed.role(),
      .prefix = parsed.prefix(),
      .source = absl::StrCat("issued ", digest.substr(0, 12)),
      .expires_unix_ms = parsed.expires_unix_ms(),
      .digest = digest,
      .root_digest = issuers->empty() ? std::string() : issuers->back(),
      .epoch = epoch};
}

int64_t Authenticator::NowMs() const {
  return absl::ToUnixMillis(options_.now());
}

absl::StatusOr<std::vector<std::string>> Authenticator::Issuers(
    const v1::TokenRecord& record) {
  std::vector<std::string> chain;
  std::string issuer = record.issuer_digest();
  // Records written before issuers were kept end their chain early.
  while (!issuer.empty()) {
    {
      absl::ReaderMutexLock lock(&mu_);
      if (file_tokens_.contains(issuer)) {
        chain.push_back(issuer);
        return chain;
      }
    }
    if (chain.size() >= kMaxIssuerChain) {
      return absl::UnauthenticatedError(absl::StrCat(
          "the token's chain of issuers is longer than ", kMaxIssuerChain));
    }
    absl::StatusOr<std::optional<std::string>> stored =
        options_.store->TryGet(absl::StrCat(kIssuedTokensPrefix, issuer));
    if (!stored.ok()) return stored.status();
    v1::TokenRecord parent;
    if (!stored->has_value() || !parent.ParseFromString(**stored)) {
      return absl::UnauthenticatedError(absl::StrCat(
          "the token is not valid here: the token that issued it (id ",
          issuer.substr(0, 12),
          "...) was revoked or removed, and every "
          "token it issued with it"));
    }
    if (parent.expires_unix_ms() != 0 && parent.expires_unix_ms() <= NowMs()) {
      return absl::UnauthenticatedError(absl::StrCat(
          "the token is not valid here: the token that issued it (id ",
          issuer.substr(0, 12), "...) expired at ",
          FormatMs(parent.expires_unix_ms())));
    }
    chain.push_back(issuer);
    issuer = parent.issuer_digest();
  }
  return chain;
}

void Authenticator::Denied(const Grant& grant, const absl::Status& why) {
  Fail(denied_, kDenied,
       absl::StrCat("auth: denied (", grant.source, "): ", why.message()));
}

absl::Status Authenticator::CheckIssue(const Grant& caller,
                                       const v1::IssueTokenRequest& request) {
  if (request.role() == v1::ADMIN && !caller.admin()) {
    absl::Status s = absl::PermissionDeniedError(
        "only an admin token may issue admin tokens");
    Denied(caller, s);
    return s;
  }
  if (absl::Status s = CheckGrantShape(request.role(), request.prefix());
      !s.ok()) {
    return s;
  }
  const int64_t max_ttl_ms = absl::ToInt64Milliseconds(options_.max_ttl);
  if (request.ttl_ms() < 0 || request.ttl_ms() > max_ttl_ms) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ttl_ms must be 0 to ", max_ttl_ms, " (cohortd's --max_token_ttl, ",
        absl::FormatDuration(options_.max_ttl), "; 0: that maximum), got ",
        request.ttl_ms()));
  }
  if (request.prefix().size() > kMaxIssuedPrefixBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "an issued token's prefix is at most ", kMaxIssuedPrefixBytes,
        " bytes; got ", request.prefix().size()));
  }
  if (request.description().size() > kMaxDescriptionBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("description is ", request.description().size(),
                     " bytes; at most ", kMaxDescriptionBytes));
  }
  if (!caller.admin()) {
    if (caller.role != v1::READ_WRITE) {
      absl::Status s =
          absl::PermissionDeniedError("a read-only token cannot issue tokens");
      Denied(caller, s);
      return s;
    }
    // A job may hand out parts of its own prefix, never more.
    if (!absl::StartsWith(request.prefix(), caller.prefix)) {
      absl::Status s = absl::PermissionDeniedError(
          absl::StrCat("the token (", caller.source,
                       ") may only issue tokens within its "
                       "prefix '",
                       absl::CHexEscape(caller.prefix), "'; '",
                       absl::CHexEscape(request.prefix().substr(0, 256)),
                       "' is outside it"));
      Denied(caller, s);
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::IssueTokenResponse> Authenticator::Issue(
    const Grant& caller, const v1::IssueTokenRequest& request) {
  if (absl::Status s = CheckIssue(caller, request); !s.ok()) return s;
  const int64_t max_ttl_ms = absl::ToInt64Milliseconds(options_.max_ttl);
  const std::string tenant = TenantOf(caller);
  if (absl::Status s = AdmitIssue(tenant); !s.ok()) {
    LogLimited(kIssue, absl::StrCat("auth: refused to issue a token to ",
                                    caller.source, ": ", s.message()));
    return s;
  }
  unsigned char random[32];
  if (RAND_bytes(random, sizeof(random)) != 1) {
    ReleaseIssue(tenant);
    return absl::InternalError("the system's random source failed");
  }
  v1::IssueTokenResponse response;
  response.set_token(absl::StrCat(
      "cht_", absl::BytesToHexString(absl::string_view(
                  reinterpret_cast<const char*>(random), sizeof(random)))));
  response.set_id(TokenDigest(response.token()));
  v1::TokenRecord record;
  record.set_role(request.role());
  record.set_prefix(request.prefix());
  record.set_description(request.description());
  record.set_issued_unix_ms(NowMs());
  // Every issued token expires, and never after the one that issued it.
  int64_t expires = record.issued_unix_ms() +
                    (request.ttl_ms() > 0 ? request.ttl_ms() : max_ttl_ms);
  if (caller.expires_unix_ms != 0) {
    expires = std::min(expires, caller.expires_unix_ms);
  }
  record.set_expires_unix_ms(expires);
  record.set_issued_by(caller.source);
  record.set_issuer_digest(caller.digest);
  // The record and its index entry in one commit.
  const std::string keys[] = {absl::StrCat(kIssuedTokensPrefix, response.id()),
                              IndexKey(request.prefix(), response.id())};
  const std::string values[] = {record.SerializeAsString(), ""};
  absl::StatusOr<int64_t> written = options_.store->MultiSet(
      absl::MakeConstSpan(keys), absl::MakeConstSpan(values));
  if (!written.ok()) {
    ReleaseIssue(tenant);
    return written.status();
  }
  response.set_expires_unix_ms(expires);
  // A tenant may issue many a second: their lines are limited like
  // failures' (the next says how many were left out).
  LogLimited(kIssue, absl::StrCat("auth: ", caller.source, " issued token ",
                                  response.id().substr(0, 12), "... (",
                                  auth::RoleName(request.role()), " under '",
                                  absl::CHexEscape(request.prefix()),
                                  "', expires ", FormatMs(expires), ")"));
  return response;
}

absl::Status Authenticator::AdmitIssue(const std::string& tenant) {
  const IssueLimits& limits = options_.issue_limits;
  const absl::Time now = options_.now();
  absl::MutexLock lock(&issue_mu_);
  Tenant& t = tenants_[tenant];
  if (limits.max_live > 0 && t.live >= limits.max_live) {
    over_max_.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(absl::StrCat(
        "this token's tenant (its file token and every token issued under "
        "it) has ",
        t.live,
        " issued tokens alive, the most --max_issued_tokens allows: revoke "
        "those no longer needed, or wait for them to expire (dead ones are "
        "swept every --token_sweep_interval)"));
  }
  if (limits.rate > 0) {
    const double burst =
        static_cast<double>(std::max<int64_t>(limits.burst, 1));
    t.bucket =
        t.refilled == absl::InfinitePast()
            ? burst
            : std::min(burst, t.bucket + limits.rate * absl::ToDoubleSeconds(
                                                           now - t.refilled));
    t.refilled = now;
    if (t.bucket < 1) {
      rate_limited_.fetch_add(1, std::memory_order_relaxed);
      return absl::ResourceExhaustedError(absl::StrCat(
          "issuing is limited to ", limits.rate,
          " tokens a second, in bursts of ", limits.burst,
          ", for a file token and every token issued under it "
          "(--token_issue_rate, --token_issue_burst); the next can be issued "
          "in ",
          absl::FormatDuration(absl::Seconds((1 - t.bucket) / limits.rate))));
    }
    t.bucket -= 1;
  }
  ++t.live;
  if (sweeping_) ++t.during_sweep;
  return absl::OkStatus();
}

void Authenticator::ReleaseIssue(const std::string& tenant) {
  absl::MutexLock lock(&issue_mu_);
  auto it = tenants_.find(tenant);
  if (it != tenants_.end() && it->second.live > 0) --it->second.live;
}

absl::Status Authenticator::Revoke(const Grant& caller, absl::string_view id) {
  if (id.size() != 64 ||
      id.find_first_not_of("0123456789abcdef") != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        "a token id is 64 lowercase hex digits (as IssueToken and ListTokens "
        "give it)");
  }
  const std::string key = absl::StrCat(kIssuedTokensPrefix, id);
  absl::StatusOr<std::optional<std::string>> record =
      options_.store->TryGet(key);
  if (!record.ok()) return record.status();
  v1::TokenRecord parsed;
  if (!record->has_value() || !parsed.ParseFromString(**record)) {
    return absl::NotFoundError(
        absl::StrCat("no issued token has id ", id.substr(0, 12), "..."));
  }
  absl::StatusOr<std::vector<std::string>> issuers = Issuers(parsed);
  if (!caller.admin() && id != caller.digest) {
    // Only what the caller issued, directly or through tokens it issued:
    // never its own issuer, nor a sibling with the same prefix.
    const bool descendant =
        issuers.ok() && std::find(issuers->begin(), issuers->end(),
                                  caller.digest) != issuers->end();
    if (caller.role != v1::READ_WRITE || !descendant) {
      absl::Status s = absl::PermissionDeniedError(absl::StrCat(
          "the token (", caller.source,
          ") may only revoke itself and the "
          "tokens it issued (directly or through tokens it issued)"));
      Denied(caller, s);
      return s;
    }
  }
  if (absl::Status s = DeleteRecord(id, parsed); !s.ok()) return s;
  if (issuers.ok()) {
    ReleaseIssue(issuers->empty() ? std::string(id) : issuers->back());
  }
  // What it issued stays in the store until the sweep, but authenticates
  // nothing from now on; calls in flight end here.
  Changed();
  LogLimited(kRevoke, absl::StrCat("auth: ", caller.source, " revoked token ",
                                   id.substr(0, 12), "..."));
  return absl::OkStatus();
}

absl::Status Authenticator::DeleteRecord(absl::string_view id,
                                         const v1::TokenRecord& record) {
  const std::string key = absl::StrCat(kIssuedTokensPrefix, id);
  const std::string index = IndexKey(record.prefix(), id);
  const store::Change changes[] = {
      {.kind = store::Change::Kind::kDelete, .key = key},
      {.kind = store::Change::Kind::kDelete, .key = index}};
  for (const store::ChangeResult& r : options_.store->ApplyBatch(changes)) {
    if (!r.status.ok()) return r.status;
  }
  return absl::OkStatus();
}

absl::Status Authenticator::Alive(absl::string_view id,
                                  const v1::TokenRecord& record, int64_t now_ms,
                                  std::string* tenant) {
  if (record.expires_unix_ms() != 0 && record.expires_unix_ms() <= now_ms) {
    return absl::UnauthenticatedError(absl::StrCat(
        "the token expired at ", FormatMs(record.expires_unix_ms())));
  }
  absl::StatusOr<std::vector<std::string>> issuers = Issuers(record);
  if (!issuers.ok()) return issuers.status();
  *tenant = issuers->empty() ? std::string(id) : issuers->back();
  return absl::OkStatus();
}

absl::StatusOr<v1::ListTokensResponse> Authenticator::List(
    const Grant& caller) {
  v1::ListTokensResponse response;
  // Through the index, so that a job reads its own records only.
  const std::string under =
      caller.admin() ? std::string(kIssuedTokensIndexPrefix)
                     : absl::StrCat(kIssuedTokensIndexPrefix,
                                    absl::BytesToHexString(caller.prefix));
  const int64_t now_ms = NowMs();
  std::string page;
  do {
    absl::StatusOr<store::ListResult> keys =
        options_.store->ListKeys(under, kRecordsPerPage, page);
    if (!keys.ok()) return keys.status();
    for (const std::string& key : keys->keys) {
      const absl::string_view id =
          absl::string_view(key).substr(key.rfind('/') + 1);
      absl::StatusOr<std::optional<std::string>> value =
          options_.store->TryGet(absl::StrCat(kIssuedTokensPrefix, id));
      v1::TokenRecord record;
      if (!value.ok() || !value->has_value() ||
          !record.ParseFromString(**value)) {
        continue;  // Revoked meanwhile.
      }
      if (!caller.admin() &&
          !absl::StartsWith(record.prefix(), caller.prefix)) {
        continue;
      }
      // Dead but not swept yet: not shown.
      std::string tenant;
      if (!Alive(id, record, now_ms, &tenant).ok()) continue;
      v1::TokenInfo* info = response.add_tokens();
      info->set_id(std::string(id));
      info->set_role(record.role());
      info->set_prefix(record.prefix());
      info->set_description(record.description());
      info->set_issued_unix_ms(record.issued_unix_ms());
      info->set_expires_unix_ms(record.expires_unix_ms());
      info->set_issued_by(record.issued_by());
    }
    page = std::move(keys->next_page_token);
  } while (!page.empty());
  return response;
}

absl::StatusOr<size_t> Authenticator::Sweep() {
  absl::MutexLock sweep_lock(&sweep_mu_);
  {
    absl::MutexLock lock(&issue_mu_);
    sweeping_ = true;
    for (auto& [key, t] : tenants_) t.during_sweep = 0;
  }
  absl::flat_hash_map<std::string, int64_t> live;
  size_t deleted = 0;
  absl::Status status;
  std::string page;
  do {
    absl::StatusOr<store::ListResult> keys =
        options_.store->ListKeys(kIssuedTokensPrefix, kRecordsPerPage, page);
    if (!keys.ok()) {
      status = keys.status();
      break;
    }
    const int64_t now_ms = NowMs();
    for (const std::string& key : keys->keys) {
      status.Update(SweepRecord(key, now_ms, live, deleted));
    }
    page = std::move(keys->next_page_token);
  } while (!page.empty());
  if (status.ok()) indexed_ = true;
  EndSweep(live, /*complete=*/status.ok());
  swept_.fetch_add(deleted, std::memory_order_relaxed);
  if (deleted > 0) {
    Changed();
    LogLimited(kSweep, absl::StrCat("auth: swept ", deleted,
                                    " records of expired or orphaned issued "
                                    "tokens"));
  }
  if (!status.ok()) return status;
  return deleted;
}

absl::Status Authenticator::SweepRecord(
    const std::string& key, int64_t now_ms,
    absl::flat_hash_map<std::string, int64_t>& live, size_t& deleted) {
  const absl::string_view id =
      absl::string_view(key).substr(kIssuedTokensPrefix.size());
  absl::StatusOr<std::optional<std::string>> value =
      options_.store->TryGet(key);
  if (!value.ok()) return value.status();
  if (!value->has_value()) return absl::OkStatus();  // Revoked meanwhile.
  v1::TokenRecord record;
  // An unreadable record authenticates nothing either.
  const bool parsed = record.ParseFromString(**value);
  std::string tenant;
  const absl::Status alive =
      parsed ? Alive(id, record, now_ms, &tenant)
             : absl::UnauthenticatedError("unreadable record");
  if (alive.ok()) {
    ++live[tenant];
    if (!indexed_) {
      const std::string index = IndexKey(record.prefix(), id);
      absl::StatusOr<std::optional<std::string>> indexed =
          options_.store->TryGet(index);
      if (indexed.ok() && !indexed->has_value()) {
        return options_.store->Set(index, "").status();
      }
    }
    return absl::OkStatus();
  }
  // A store error is no proof of death.
  if (!absl::IsUnauthenticated(alive)) return alive;
  absl::Status gone = DeleteRecord(id, record);
  if (gone.ok()) ++deleted;
  return gone;
}

void Authenticator::EndSweep(
    const absl::flat_hash_map<std::string, int64_t>& live, bool complete) {
  const absl::Time now = options_.now();
  absl::MutexLock lock(&issue_mu_);
  sweeping_ = false;
  // Only a whole scan counts; a partial one keeps the counts as they
  // are (an upper bound: revocations lower them, issues raise them).
  if (!complete) return;
  for (const auto& counted : live) tenants_[counted.first];
  const IssueLimits& limits = options_.issue_limits;
  for (auto it = tenants_.begin(); it != tenants_.end();) {
    Tenant& t = it->second;
    auto counted = live.find(it->first);
    t.live = (counted == live.end() ? 0 : counted->second) + t.during_sweep;
    const bool full =
        limits.rate <= 0 || t.refilled == absl::InfinitePast() ||
        t.bucket + limits.rate * absl::ToDoubleSeconds(now - t.refilled) >=
            static_cast<double>(limits.burst);
    // Forgetting a tenant with nothing alive and a full bucket changes
    // nothing it may do, and keeps the table to the active tenants.
    if (t.live == 0 && full) {
      tenants_.erase(it++);
    } else {
      ++it;
    }
  }
}

absl::Status Authenticator::CheckExpiry(const Grant& grant) const {
  if (grant.expires_unix_ms == 0 || grant.expires_unix_ms > NowMs()) {
    return absl::OkStatus();
  }
  return absl::UnauthenticatedError(
      absl::StrCat("the token expired at ", FormatMs(grant.expires_unix_ms)));
}

absl::Status Authenticator::Recheck(const Grant& grant) {
  if (absl::Status s = CheckExpiry(grant); !s.ok()) return s;
  if (grant.digest.empty()) return absl::OkStatus();  // Auth off.
  const uint64_t epoch = epoch_.load();
  if (epoch == grant.epoch) return absl::OkStatus();
  // A file token's verdict depends on its line, not only its digest.
  const std::string key =
      absl::StrCat(grant.digest, ":", grant.role, ":", grant.prefix);
  {
    absl::MutexLock lock(&verdict_mu_);
    if (verdict_epoch_ == epoch) {
      if (auto it = verdicts_.find(key); it != verdicts_.end()) {
        return it->second;
      }
    }
  }
  absl::Status verdict = Validate(grant);
  if (verdict.ok() || absl::IsUnauthenticated(verdict)) {
    absl::MutexLock lock(&verdict_mu_);
    if (verdict_epoch_ < epoch) {
      verdicts_.clear();
      verdict_epoch_ = epoch;
    }
    if (verdict_epoch_ == epoch) verdicts_.emplace(key, verdict);
  }
  return verdict;
}

absl::Status Authenticator::Validate(const Grant& grant) {
  if (grant.root_digest == grant.digest) {  // A file token.
    absl::ReaderMutexLock lock(&mu_);
    auto it = file_tokens_.find(grant.digest);
    if (it == file_tokens_.end()) {
      return absl::UnauthenticatedError(
          "the token was removed from the tokens file");
    }
    if (it->second.role != grant.role || it->second.prefix != grant.prefix) {
      return absl::UnauthenticatedError(absl::StrCat(
          "the token's line in the tokens file changed (", it->second.source,
          "): call again to be granted what it says now"));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::optional<std::string>> stored =
      options_.store->TryGet(absl::StrCat(kIssuedTokensPrefix, grant.digest));
  if (!stored.ok()) return stored.status();
  v1::TokenRecord record;
  if (!stored->has_value() || !record.ParseFromString(**stored)) {
    return absl::UnauthenticatedError(absl::StrCat(
        "the token (id ", grant.digest.substr(0, 12), "...) was revoked"));
  }
  std::string tenant;
  return Alive(grant.digest, record, NowMs(), &tenant);
}

absl::StatusOr<Authenticator::GrantWatchId> Authenticator::WatchGrant(
    const Grant& grant, std::function<void(absl::Status)> end) {
  auto watched =
      std::make_shared<const Watched>(Watched{grant, std::move(end)});
  GrantWatchId id;
  {
    absl::MutexLock lock(&watch_mu_);
    id = next_watch_++;
    watched_.emplace(id, std::move(watched));
  }
  // Registered first: a change from now on reaches it through Changed, and
  // one made since Authenticate shows here as a new epoch.
  if (absl::Status s = Recheck(grant); !s.ok()) {
    ForgetGrant(id);
    return s;
  }
  return id;
}

void Authenticator::ForgetGrant(GrantWatchId id) {
  absl::MutexLock lock(&watch_mu_);
  watched_.erase(id);
}

void Authenticator::Changed() {
  epoch_.fetch_add(1);
  std::vector<std::pair<GrantWatchId, std::shared_ptr<const Watched>>> all;
  {
    absl::MutexLock lock(&watch_mu_);
    all.assign(watched_.begin(), watched_.end());
  }
  size_t ended = 0;
  for (const auto& [id, watched] : all) {
    absl::Status why = Recheck(watched->grant);
    // A store error proves nothing: the call goes on, and is checked again
    // when it next acts or at the next change.
    if (!absl::IsUnauthenticated(why)) continue;
    {
      absl::MutexLock lock(&watch_mu_);
      if (watched_.erase(id) == 0) continue;  // Ended or forgotten already.
    }
    ++ended;
    watched->end(why);
  }
  if (ended > 0) {
    calls_ended_.fetch_add(ended, std::memory_order_relaxed);
    LogLimited(kRevoke, absl::StrCat("auth: ended ", ended,
                                     " calls in flight whose token stopped "
                                     "holding"));
  }
}

AuthStats Authenticator::stats() const {
  auto get = [](const std::atomic<uint64_t>& a) {
    return a.load(std::memory_order_relaxed);
  };
  uint64_t issued = 0;
  {
    absl::MutexLock lock(&issue_mu_);
    for (const auto& [key, t] : tenants_) {
      issued += static_cast<uint64_t>(std::max<int64_t>(t.live, 0));
    }
  }
  return {.missing_token = get(missing_),
          .malformed_token = get(malformed_),
          .unknown_token = get(unknown_),
          .expired_token = get(expired_),
          .permission_denied = get(denied_),
          .authenticated = get(authenticated_),
          .reloads = get(reloads_),
          .reload_failures = get(reload_failures_),
          .swept_tokens = get(swept_),
          .issue_rate_limited = get(rate_limited_),
          .issue_over_max = get(over_max_),
          .issued_tokens = issued,
          .calls_ended = get(calls_ended_)};
}

absl::StatusOr<Grant> CallerGrant(Authenticator* auth,
                                  const grpc::CallbackServerContext& ctx) {
  if (auth == nullptr) {
    return Grant{.role = v1::ADMIN, .prefix = "*", .source = "auth off"};
  }
  return auth->Authenticate(ctx.client_metadata());
}

absl::Status AuthorizeCall(Authenticator* auth,
                           const grpc::CallbackServerContext& ctx,
                           absl::string_view what,
                           absl::Span<const std::string> names, Access access,
                           Grant* granted) {
  if (auth == nullptr) return absl::OkStatus();
  absl::StatusOr<Grant> grant = auth->Authenticate(ctx.client_metadata());
  if (!grant.ok()) return grant.status();
  for (const std::string& name : names) {
    if (absl::Status s = CheckAccess(*grant, what, name, access); !s.ok()) {
      auth->Denied(*grant, s);
      return s;
    }
  }
  if (granted != nullptr) *granted = *std::move(grant);
  return absl::OkStatus();
}

absl::StatusOr<std::string> AuthorizedPrefix(
    Authenticator* auth, const grpc::CallbackServerContext& ctx,
    absl::string_view requested, Grant* granted) {
  if (auth == nullptr) return std::string(requested);
  absl::StatusOr<Grant> grant = auth->Authenticate(ctx.client_metadata());
  if (!grant.ok()) return grant.status();
  absl::StatusOr<std::string> narrowed = NarrowPrefix(*grant, requested);
  if (!narrowed.ok()) {
    auth->Denied(*grant, narrowed.status());
  } else if (granted != nullptr) {
    *granted = *std::move(grant);
  }
  return narrowed;
}

}  // namespace cohort::server

// Authenticator: cohortd's tokens (proto/cohort/v1/auth.proto has the
// rules users see). It maps the token a call carries to a Grant (a role
// under a prefix), from the --auth_tokens file or from the tokens issued
// through the Auth service, which live in the store as SHA-256 digests.
// The services then check every name a call touches with AuthorizeCall.
//
// A null Authenticator* means auth is off: every call is allowed.
//
// Issued tokens end three ways: revoked (RevokeToken), orphaned (a token
// above them revoked, removed from the file or expired) or expired. Their
// records are deleted by Sweep, which cohortd runs every
// --token_sweep_interval. Calls that outlive their authentication (watch
// streams, parked waits, TCPStore connections) learn of the end through
// WatchGrant (at once) and Recheck (when they next act).
#ifndef COHORT_SERVER_AUTH_AUTH_H_
#define COHORT_SERVER_AUTH_AUTH_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/log_limiter.h"
#include "cohort/v1/auth.pb.h"
#include "grpcpp/server_context.h"
#include "store/kv_store.h"

namespace cohort::server {

// What a token allows.
struct Grant {
  v1::Role role = v1::ROLE_UNSPECIFIED;
  // "*" for an admin.
  std::string prefix;
  // "file line N", "issued <id>", or "auth off".
  std::string source;
  // Unix milliseconds; 0: never.
  int64_t expires_unix_ms = 0;
  // The hex SHA-256 digest of the token (empty with auth off).
  std::string digest;
  // The digest of the tokens-file token at the head of its chain of
  // issuers: its own for a file token (empty with auth off, and for issued
  // tokens recorded before issuers were kept). Quotas are charged to it, so
  // that issuing tokens never multiplies a tenant's share.
  std::string root_digest;
  // Authenticator::epoch() when the token was checked: while it is
  // unchanged, Recheck needs only the clock.
  uint64_t epoch = 0;

  bool admin() const { return role == v1::ADMIN; }
};

enum class Access { kRead, kWrite };

// Where issued tokens are kept: kIssuedTokensPrefix + hex SHA-256 digest.
inline constexpr absl::string_view kIssuedTokensPrefix = "/cohort/auth/tokens/";
// An index of them by prefix (empty values): kIssuedTokensIndexPrefix +
// hex(prefix) + "/" + digest. Hex keeps "starts with" (hex(P) starts with
// hex(Q) iff P starts with Q), so a job's ListTokens lists
// kIssuedTokensIndexPrefix + hex(its prefix) and reads no other job's
// records.
inline constexpr absl::string_view kIssuedTokensIndexPrefix =
    "/cohort/auth/prefixes/";
// The key namespaces of runs: the keys of run R live under NAMESPACE + R
// (cohortrun's workers' torch stores under "/cohortrun/", the store prefix
// a rendezvous hands out under "runs/"). A token's prefix P covers
// NAMESPACE + P too, so a token for run R covers R's keys.
inline constexpr absl::string_view kRunNamespaces[] = {"/cohortrun/", "runs/"};

// Whether `prefix` covers `name`: "*" covers everything; otherwise `name`
// starts with `prefix`, or `prefix` ends in '/' and `name` is `prefix`
// without it.
bool Covers(absl::string_view prefix, absl::string_view name);
// Covers for keys: also true under each of kRunNamespaces + prefix.
bool CoversKey(absl::string_view prefix, absl::string_view key);

// Whether `grant` allows `access` on `name` (a key when `what` is "key",
// else a run or group name): OK, or PERMISSION_DENIED naming the prefix.
absl::Status CheckAccess(const Grant& grant, absl::string_view what,
                         absl::string_view name, Access access);
// `requested` (a ListKeys/Watch/NumKeys prefix) narrowed to the keys
// `grant` may read. Its roots are P and each kRunNamespaces + P: unchanged
// when it lies under a root (so every key it can match is covered); else
// the first root that lies under it; PERMISSION_DENIED when they do not
// meet. Unlike CoversKey, never the bare run name: the prefix "job1" is
// narrowed to "job1/", since as a prefix it would match "job10/...".
absl::StatusOr<std::string> NarrowPrefix(const Grant& grant,
                                         absl::string_view requested);

// The hex SHA-256 digest of `token` (an issued token's id).
std::string TokenDigest(absl::string_view token);

// One line of a tokens file, parsed.
struct FileToken {
  std::string digest;
  Grant grant;
};

// Parses a tokens file: one token a line, "TOKEN ROLE PREFIX", ROLE r, rw
// or admin (whose PREFIX is *), '#' starts a comment, blank lines are
// skipped. INVALID_ARGUMENT naming `path` and the line for a malformed
// line, an unknown role, a token shorter than 16 bytes, a duplicate; the
// token itself is never quoted.
absl::StatusOr<std::vector<FileToken>> ParseTokensFile(absl::string_view text,
                                                       absl::string_view path);

// Counts of authentication and authorization failures, by cause.
struct AuthStats {
  uint64_t missing_token = 0;    // No token on a call that needs one.
  uint64_t malformed_token = 0;  // Not a token at all (bad header).
  uint64_t unknown_token = 0;    // Not in the file, not issued (or revoked).
  uint64_t expired_token = 0;
  uint64_t permission_denied = 0;  // Valid token, name or role beyond it.
  uint64_t authenticated = 0;
  uint64_t reloads = 0;
  uint64_t reload_failures = 0;
  // Records of dead issued tokens (expired or orphaned) deleted by Sweep.
  uint64_t swept_tokens = 0;
  // IssueToken calls refused by IssueLimits: over the rate, and at the
  // bound on live tokens.
  uint64_t issue_rate_limited = 0;
  uint64_t issue_over_max = 0;
  // Issued tokens alive, over every tenant (as of the last sweep, plus
  // those issued since, less those revoked since).
  uint64_t issued_tokens = 0;
  // Calls in flight ended through WatchGrant: their token, or one above
  // it, was revoked, removed or expired.
  uint64_t calls_ended = 0;
};

// Bounds on issuing, per tenant: a file token and every token issued under
// it (Grant::root_digest), so that minting children never multiplies a
// share. Zero turns a bound off.
struct IssueLimits {
  // Tokens a second (--token_issue_rate), in bursts of up to `burst`
  // (--token_issue_burst): a token bucket. The default lets a 1,000-node
  // cohortrun job start at once (one token per node).
  double rate = 100;
  int64_t burst = 1000;
  // Issued tokens alive at once (--max_issued_tokens). A rate alone would
  // still pile up records with long TTLs.
  int64_t max_live = 10000;
};

struct AuthenticatorOptions {
  // The --auth_tokens file; required.
  std::string tokens_file;
  // Where issued tokens live. Not owned; must outlive the Authenticator.
  store::KvStore* store = nullptr;
  // Where reloads and (rate-limited, once a second per cause) failures are
  // reported.
  std::function<void(absl::string_view)> log;
  // The longest lifetime an issued token may have (--max_token_ttl); a
  // request for 0 gets this.
  absl::Duration max_ttl = absl::Hours(24 * 30);
  IssueLimits issue_limits;
  // How often a thread of the Authenticator's own runs Sweep
  // (--token_sweep_interval); zero: never by itself (tests call Sweep).
  absl::Duration sweep_interval = absl::ZeroDuration();
  // The clock every expiry and the issue rate are measured on (tests pass
  // their own).
  std::function<absl::Time()> now = absl::Now;
};

class Authenticator {
 public:
  // Loads the tokens file; fails with its error if it does not parse or
  // cannot be read. An empty file is allowed (only issued tokens, which
  // then nobody can issue: say so in the log).
  // Then sweeps once (which also indexes records written by versions
  // without the prefix index) and watches the issued tokens' records, so
  // that their deletion by another replica over a shared store bumps
  // epoch() too.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Start(
      AuthenticatorOptions options);
  // Stops the sweeping thread and the store watch.
  ~Authenticator();

  // Re-reads the tokens file. On an error the tokens in force stay as they
  // were, and the error is returned (and logged).
  absl::Status Reload();
  // Reloads if the file's size, modification time or inode changed since
  // the last load. Returns whether it reloaded successfully.
  bool ReloadIfChanged();

  // The grant of the token in `metadata` ("authorization: Bearer T" or
  // "cohort-token: T"), or UNAUTHENTICATED saying what is wrong (never
  // quoting the token). Counts the outcome.
  absl::StatusOr<Grant> Authenticate(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata);

  // The grant of `token` itself (as Authenticate, for the TCPStore
  // listener's token hello).
  absl::StatusOr<Grant> AuthenticateToken(absl::string_view token);

  // Counts a PERMISSION_DENIED and logs it (rate-limited).
  void Denied(const Grant& grant, const absl::Status& why);

  // The Auth service's calls, for `caller`. Issue is RESOURCE_EXHAUSTED
  // naming the flag over IssueLimits. List shows live tokens only, and
  // reads only the records within the caller's prefix.
  absl::StatusOr<v1::IssueTokenResponse> Issue(
      const Grant& caller, const v1::IssueTokenRequest& request);
  absl::Status Revoke(const Grant& caller, absl::string_view id);
  absl::StatusOr<v1::ListTokensResponse> List(const Grant& caller);

  // Deletes the records of dead issued tokens: expired, or whose chain of
  // issuers is broken (one revoked, removed from the file or expired), and
  // recounts each tenant's live tokens. Pages through the records with no
  // lock held that calls wait on; one sweep at a time. Returns how many it
  // deleted, or the store's error (the rest is left to the next sweep).
  absl::StatusOr<size_t> Sweep();

  // --- Revocation of calls in flight. The API the RPC glue (watch streams,
  // parked waits) and the TCPStore listener use; all thread-safe.
  //
  // Bumped by every change that can end a grant: a revocation, a reload of
  // the tokens file, a sweep that deleted records, and any deletion of an
  // issued token's record in the store (another replica's revocation).
  uint64_t epoch() const { return epoch_.load(); }

  // Whether `grant` (from Authenticate) still holds: OK, or UNAUTHENTICATED
  // saying why (expired; revoked; a token that issued it revoked, removed
  // or expired; removed from the tokens file, or its line changed), or the
  // store's error. While epoch() is grant.epoch it compares the expiry with
  // the clock and nothing else; after a change it reads the token's
  // records once per token and epoch (the verdict is shared by every call
  // of that token). REQUIRES: not called under the store's lock (from a
  // store watch callback); use CheckExpiry there.
  absl::Status Recheck(const Grant& grant);
  // The clock part of Recheck alone: never touches the store or a lock.
  absl::Status CheckExpiry(const Grant& grant) const;

  // Calls `end` once with Recheck's UNAUTHENTICATED as soon as `grant`
  // stops holding through a change this Authenticator sees: on the thread
  // that revoked, reloaded or swept (so before RevokeToken returns), or on
  // the sweeping thread for another replica's deletion. `end` must not
  // block; it may run after ForgetGrant if it was already under way, so it
  // must hold on to what it uses (a weak or shared handle). Returns the
  // status instead, calling nothing, when `grant` no longer holds now
  // (which closes the race with a change made since Authenticate).
  using GrantWatchId = uint64_t;
  absl::StatusOr<GrantWatchId> WatchGrant(
      const Grant& grant, std::function<void(absl::Status)> end);
  // Stops watching (unknown ids are ignored). Call it when the call ends.
  void ForgetGrant(GrantWatchId id);

  AuthStats stats() const;

 private:
  explicit Authenticator(AuthenticatorOptions options);
  // Logs at most once a second per cause.
  void LogLimited(int cause, absl::string_view line);
  void Fail(std::atomic<uint64_t>& counter, int cause, absl::string_view line);
  // Follows the issuers of the token whose record is `record` up to a file
  // token: their digests, nearest first, the file token's last (the list
  // ends early for records written before issuers were kept); or
  // UNAUTHENTICATED when one of them was revoked, removed or expired.
  absl::StatusOr<std::vector<std::string>> Issuers(
      const v1::TokenRecord& record);
  int64_t NowMs() const;
  // Recheck's slow part: reads the records of `grant`'s token.
  absl::Status Validate(const Grant& grant);
  // Whether `record` (the token `id`) is alive at `now_ms`: OK, or why not.
  // Sets `tenant` to its tenant's key.
  absl::Status Alive(absl::string_view id, const v1::TokenRecord& record,
                     int64_t now_ms, std::string* tenant);
  // Deletes a record and its index entry in one commit.
  absl::Status DeleteRecord(absl::string_view id,
                            const v1::TokenRecord& record);
  // Takes one issue from `tenant`'s bucket and live count, or says which
  // bound refuses it.
  // One issued-token record of a sweep: counted under its tenant in `live`
  // while alive (its index entry restored if missing), deleted (and
  // counted in `deleted`) once dead. The store's error, if any.
  absl::Status SweepRecord(const std::string& key, int64_t now_ms,
                           absl::flat_hash_map<std::string, int64_t>& live,
                           size_t& deleted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sweep_mu_);
  // Recounts every tenant's live tokens from a `complete` scan (a partial
  // one changes nothing) and forgets idle tenants.
  void EndSweep(const absl::flat_hash_map<std::string, int64_t>& live,
                bool complete) ABSL_EXCLUSIVE_LOCKS_REQUIRED(sweep_mu_);
  // Whether `caller` may issue what `request` asks for (role, prefix,
  // TTL, sizes); refusals of the caller are counted as denials.
  absl::Status CheckIssue(const Grant& caller,
                          const v1::IssueTokenRequest& request);
  absl::Status AdmitIssue(const std::string& tenant);
  void ReleaseIssue(const std::string& tenant);
  // Bumps epoch_, then ends the watched grants that stopped holding.
  void Changed();
  // Watches the issued tokens' records (Start).
  absl::Status WatchRecords();
  // The sweeping thread's loop, and what wakes it early.
  void SweepLoop();
  bool Woken() const ABSL_SHARED_LOCKS_REQUIRED(wake_mu_) {
    return stopping_ || deleted_elsewhere_;
  }

  const AuthenticatorOptions options_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Grant> file_tokens_ ABSL_GUARDED_BY(mu_);
  // What the last load saw of the file: size, mtime (ns), inode.
  uint64_t file_size_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t file_mtime_ns_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t file_inode_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Mutex log_mu_;
  std::vector<base::LogLimiter> limiters_ ABSL_GUARDED_BY(log_mu_);

  std::atomic<uint64_t> missing_{0}, malformed_{0}, unknown_{0}, expired_{0},
      denied_{0}, authenticated_{0}, reloads_{0}, reload_failures_{0},
      swept_{0}, rate_limited_{0}, over_max_{0}, calls_ended_{0};

  std::atomic<uint64_t> epoch_{1};

  // Recheck's verdicts for verdict_epoch_, by token digest: the calls of
  // one token share one read of its records after each change.
  absl::Mutex verdict_mu_;
  uint64_t verdict_epoch_ ABSL_GUARDED_BY(verdict_mu_) = 0;
  absl::flat_hash_map<std::string, absl::Status> verdicts_
      ABSL_GUARDED_BY(verdict_mu_);

  struct Watched {
    Grant grant;
    std::function<void(absl::Status)> end;
  };
  absl::Mutex watch_mu_;
  GrantWatchId next_watch_ ABSL_GUARDED_BY(watch_mu_) = 1;
  absl::flat_hash_map<GrantWatchId, std::shared_ptr<const Watched>> watched_
      ABSL_GUARDED_BY(watch_mu_);

  // Per tenant (Grant::root_digest, or the digest of a token recorded
  // before issuers were kept): its issue bucket and live issued tokens.
  struct Tenant {
    double bucket = 0;
    absl::Time refilled = absl::InfinitePast();
    int64_t live = 0;
    // Issued while a sweep was counting (added to what it counted).
    int64_t during_sweep = 0;
  };
  mutable absl::Mutex issue_mu_;
  absl::flat_hash_map<std::string, Tenant> tenants_ ABSL_GUARDED_BY(issue_mu_);
  bool sweeping_ ABSL_GUARDED_BY(issue_mu_) = false;

  // Serializes sweeps; held across the scan, but no call waits on it.
  absl::Mutex sweep_mu_;
  // Whether a sweep has indexed every record (the first one does).
  bool indexed_ ABSL_GUARDED_BY(sweep_mu_) = false;
  // The store watch on kIssuedTokensPrefix (0: none).
  std::atomic<uint64_t> records_watch_{0};
  // Set by the store watch (which may not call back into the store):
  // the sweeping thread then runs Changed.
  absl::Mutex wake_mu_;
  bool deleted_elsewhere_ ABSL_GUARDED_BY(wake_mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(wake_mu_) = false;
  std::thread sweeper_;
};

// The checks every service makes. With auth off (`auth` null) they allow
// everything.
//
// Authenticates the call and checks that its token grants `access` on each
// of `names` (keys when `what` is "key", else run or group names). Returns
// UNAUTHENTICATED or PERMISSION_DENIED naming the prefix. `granted`, when
// not null, gets the grant (for a call that lasts: Recheck, WatchGrant);
// untouched with auth off.
absl::Status AuthorizeCall(Authenticator* auth,
                           const grpc::CallbackServerContext& ctx,
                           absl::string_view what,
                           absl::Span<const std::string> names, Access access,
                           Grant* granted = nullptr);
inline absl::Status AuthorizeCall(Authenticator* auth,
                                  const grpc::CallbackServerContext& ctx,
                                  absl::string_view what,
                                  const std::string& name, Access access,
                                  Grant* granted = nullptr) {
  return AuthorizeCall(auth, ctx, what, absl::MakeConstSpan(&name, 1), access,
                       granted);
}

// For ListKeys, NumKeys and Watch: `requested` narrowed to what the call's
// token may read (unchanged for an admin or with auth off).
// PERMISSION_DENIED when they do not meet. `granted` as for AuthorizeCall.
absl::StatusOr<std::string> AuthorizedPrefix(
    Authenticator* auth, const grpc::CallbackServerContext& ctx,
    absl::string_view requested, Grant* granted = nullptr);

// The caller's grant (an admin grant "auth off" when `auth` is null).
absl::StatusOr<Grant> CallerGrant(Authenticator* auth,
                                  const grpc::CallbackServerContext& ctx);

}  // namespace cohort::server

#endif  // COHORT_SERVER_AUTH_AUTH_H_

// Authenticator: cohortd's tokens (proto/cohort/v1/auth.proto has the
// rules users see). It maps the token a call carries to a Grant (a role
// under a prefix), from the --auth_tokens file or from the tokens issued
// through the Auth service, which live in the store as SHA-256 digests.
// The services then check every name a call touches with AuthorizeCall.
//
// A null Authenticator* means auth is off: every call is allowed.
#ifndef COHORT_SERVER_AUTH_H_
#define COHORT_SERVER_AUTH_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
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

  bool admin() const { return role == v1::ADMIN; }
};

enum class Access { kRead, kWrite };

// Where issued tokens are kept: kIssuedTokensPrefix + hex SHA-256 digest.
inline constexpr absl::string_view kIssuedTokensPrefix = "/cohort/auth/tokens/";
// The key namespaces of runs: the keys of run R live under NAMESPACE + R
// (cohortrun's workers' torch stores under "/cohortrun/", the store prefix
// a rendezvous hands out under "runs/"). A token's prefix P covers
// NAMESPACE + P too, so a token for run R covers R's keys.
inline constexpr absl::string_view kRunNamespaces[] = {"/cohortrun/",
                                                       "runs/"};

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
  uint64_t missing_token = 0;   // No token on a call that needs one.
  uint64_t malformed_token = 0; // Not a token at all (bad header).
  uint64_t unknown_token = 0;   // Not in the file, not issued (or revoked).
  uint64_t expired_token = 0;
  uint64_t permission_denied = 0;  // Valid token, name or role beyond it.
  uint64_t authenticated = 0;
  uint64_t reloads = 0;
  uint64_t reload_failures = 0;
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
};

class Authenticator {
 public:
  // Loads the tokens file; fails with its error if it does not parse or
  // cannot be read. An empty file is allowed (only issued tokens, which
  // then nobody can issue: say so in the log).
  static absl::StatusOr<std::unique_ptr<Authenticator>> Start(
      AuthenticatorOptions options);

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

  // The Auth service's calls, for `caller`.
  absl::StatusOr<v1::IssueTokenResponse> Issue(
      const Grant& caller, const v1::IssueTokenRequest& request);
  absl::Status Revoke(const Grant& caller, absl::string_view id);
  absl::StatusOr<v1::ListTokensResponse> List(const Grant& caller);

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
      denied_{0}, authenticated_{0}, reloads_{0}, reload_failures_{0};
};

// The checks every service makes. With auth off (`auth` null) they allow
// everything.
//
// Authenticates the call and checks that its token grants `access` on each
// of `names` (keys when `what` is "key", else run or group names). Returns
// UNAUTHENTICATED or PERMISSION_DENIED naming the prefix.
absl::Status AuthorizeCall(Authenticator* auth,
                           const grpc::CallbackServerContext& ctx,
                           absl::string_view what,
                           absl::Span<const std::string> names, Access access);
inline absl::Status AuthorizeCall(Authenticator* auth,
                                  const grpc::CallbackServerContext& ctx,
                                  absl::string_view what,
                                  const std::string& name, Access access) {
  return AuthorizeCall(auth, ctx, what, absl::MakeConstSpan(&name, 1), access);
}

// For ListKeys, NumKeys and Watch: `requested` narrowed to what the call's
// token may read (unchanged for an admin or with auth off).
// PERMISSION_DENIED when they do not meet.
absl::StatusOr<std::string> AuthorizedPrefix(
    Authenticator* auth, const grpc::CallbackServerContext& ctx,
    absl::string_view requested);

// The caller's grant (an admin grant "auth off" when `auth` is null).
absl::StatusOr<Grant> CallerGrant(Authenticator* auth,
                                  const grpc::CallbackServerContext& ctx);

}  // namespace cohort::server

#endif  // COHORT_SERVER_AUTH_H_

// Quotas: what one tenant may hold of cohortd at once, so that one token
// (or, with auth off, one connection) cannot exhaust the server for the
// others. A tenant is an owner string: "token <12 hex digits of the file
// token heading the caller's chain of issuers>", so the tokens a job issues
// share its quota; or "connection <peer>" with auth off. Admin tokens are
// operators, not tenants: callers do not charge them.
//
// Each quota is a counter per owner with one limit for all owners. Callers
// Take before they hold the resource and Give it back when they let go; a
// Take over the limit changes nothing and returns RESOURCE_EXHAUSTED naming
// the quota, its flag, the owner, what is in use and the limit, so one
// owner's refusal never affects another's.
#ifndef COHORT_SERVER_AUTH_QUOTA_H_
#define COHORT_SERVER_AUTH_QUOTA_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/auth/auth.h"
#include "store/kv_store.h"

namespace cohort::server {

enum class Quota {
  kQueueBytes,    // Bytes in TCPStore queues pushed by the owner.
  kWaits,         // Waits parked at once (gRPC Wait, TCPStore WAIT).
  kWaitedKeys,    // Keys named by those waits, together.
  kWatchStreams,  // gRPC Watch streams open at once.
  kConnections,   // TCPStore connections open at once.
};
inline constexpr int kNumQuotas = 5;

struct QuotaLimits {
  uint64_t queue_bytes = 256ull << 20;  // --quota_queue_bytes
  // Every rank of a job may block on a key at once (a store barrier: each
  // rank waits for the last to arrive), all under the job's one token: a
  // 64Ki-rank job fits. Keys are at most 4 KiB (--max_key_bytes), so the
  // keys bound holds a tenant's parked waits to 256 MiB of key bytes.
  uint64_t waits = 65536;        // --quota_waits
  uint64_t waited_keys = 65536;  // --quota_waited_keys
  uint64_t watch_streams = 64;   // --quota_watch_streams
  uint64_t connections = 4096;   // --quota_connections

  uint64_t limit(Quota quota) const;
};

// The quota's name in messages and metrics ("queue_bytes") and its flag
// ("--quota_queue_bytes").
absl::string_view QuotaName(Quota quota);
absl::string_view QuotaFlag(Quota quota);

struct QuotaStats {
  // Takes refused, by quota.
  std::array<uint64_t, kNumQuotas> refused{};
  // Owners holding anything now.
  uint64_t owners = 0;
  // What they hold now, by quota, all together.
  std::array<uint64_t, kNumQuotas> used{};
};

class Quotas;

// What one call holds of its owner's quotas (Quotas::Charge), given back
// when it is destroyed: a reactor holds it, so the charge ends with the
// call however the call ends. Movable; an empty charge gives back nothing.
class QuotaCharge {
 public:
  QuotaCharge() = default;
  QuotaCharge(QuotaCharge&& other) noexcept;
  QuotaCharge& operator=(QuotaCharge&& other) noexcept;
  ~QuotaCharge() { Release(); }

  // Gives everything back now. Idempotent.
  void Release();

 private:
  friend class Quotas;
  Quotas* quotas_ = nullptr;
  std::string owner_;
  std::array<uint64_t, kNumQuotas> amounts_{};
};

class Quotas {
 public:
  explicit Quotas(QuotaLimits limits) : limits_(limits) {}

  // Charges `amount` of `quota` to `owner`: OK, or RESOURCE_EXHAUSTED
  // (and nothing charged) when that would pass the limit. An owner of ""
  // (an admin) is charged nothing. Thread-safe.
  absl::Status Take(absl::string_view owner, Quota quota, uint64_t amount);
  // Gives back what a Take charged. REQUIRES: it was taken.
  void Give(absl::string_view owner, Quota quota, uint64_t amount);
  uint64_t Used(absl::string_view owner, Quota quota) const;

  // Takes every (quota, amount) of `amounts` for `owner`, all or none: the
  // first refusal is returned and whatever was taken before it is given
  // back. The charge gives them back when destroyed; it must not outlive
  // this object. An owner of "" (an admin) is charged nothing.
  absl::StatusOr<QuotaCharge> Charge(
      absl::string_view owner,
      std::initializer_list<std::pair<Quota, uint64_t>> amounts);

  const QuotaLimits& limits() const { return limits_; }
  QuotaStats stats() const;

 private:
  const QuotaLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::array<uint64_t, kNumQuotas>> used_
      ABSL_GUARDED_BY(mu_);
  std::array<std::atomic<uint64_t>, kNumQuotas> refused_{};
};

// The owner a call's grant is charged to, or "" for an admin (not
// charged). With auth off (`grant` null), "connection " + `peer`.
std::string QuotaOwner(const Grant* grant, absl::string_view peer);

// The keys and bytes a tenant stores are the store's to bound, whichever
// protocol writes them (store::KvStore::SetShares, with --quota_keys and
// --quota_bytes). A tenant's share is the keys its tokens can write: under
// the prefix P of each read-write file token, and under each of
// kRunNamespaces + P; named by its QuotaOwner. Admin and read-only tokens
// have none.
std::vector<store::Share> TenantShares(absl::Span<const FileToken> tokens);
// Reads and parses `tokens_file` and sets its tenants' shares on `store`:
// its error, or the read's or a share's scan.
absl::Status SetTenantShares(const std::string& tokens_file,
                             store::KvStore& store);

}  // namespace cohort::server

#endif  // COHORT_SERVER_AUTH_QUOTA_H_

#include "server/auth/quota.h"

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace cohort::server {
namespace {

size_t Index(Quota quota) { return static_cast<size_t>(quota); }

// What a refusal asks the owner to do about it.
absl::string_view Advice(Quota quota) {
  switch (quota) {
    case Quota::kQueueBytes:
      return "pop or delete queued items, or raise the flag";
    case Quota::kWaits:
    case Quota::kWaitedKeys:
      return "let blocked waits finish or cancel them, wait on fewer keys "
             "at once, or raise the flag";
    case Quota::kWatchStreams:
      return "close watch streams you no longer read (one stream can watch "
             "a whole prefix), or raise the flag";
    case Quota::kConnections:
      return "close idle connections or share them, or raise the flag";
  }
  return "raise the flag";
}

}  // namespace

uint64_t QuotaLimits::limit(Quota quota) const {
  switch (quota) {
    case Quota::kQueueBytes:
      return queue_bytes;
    case Quota::kWaits:
      return waits;
    case Quota::kWaitedKeys:
      return waited_keys;
    case Quota::kWatchStreams:
      return watch_streams;
    case Quota::kConnections:
      return connections;
  }
  return 0;
}

absl::string_view QuotaName(Quota quota) {
  switch (quota) {
    case Quota::kQueueBytes:
      return "queue_bytes";
    case Quota::kWaits:
      return "waits";
    case Quota::kWaitedKeys:
      return "waited_keys";
    case Quota::kWatchStreams:
      return "watch_streams";
    case Quota::kConnections:
      return "connections";
  }
  return "unknown";
}

absl::string_view QuotaFlag(Quota quota) {
  switch (quota) {
    case Quota::kQueueBytes:
      return "--quota_queue_bytes";
    case Quota::kWaits:
      return "--quota_waits";
    case Quota::kWaitedKeys:
      return "--quota_waited_keys";
    case Quota::kWatchStreams:
      return "--quota_watch_streams";
    case Quota::kConnections:
      return "--quota_connections";
  }
  return "unknown";
}

absl::Status Quotas::Take(absl::string_view owner, Quota quota,
                          uint64_t amount) {
  if (owner.empty() || amount == 0) return absl::OkStatus();
  const size_t q = Index(quota);
  const uint64_t limit = limits_.limit(quota);
  uint64_t used = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = used_.find(owner);
    used = it == used_.end() ? 0 : it->second[q];
    // Written so that a huge `amount` cannot wrap around the limit.
    if (amount <= limit && used <= limit - amount) {
      if (it == used_.end()) {
        it =
            used_
                .emplace(std::string(owner), std::array<uint64_t, kNumQuotas>{})
                .first;
      }
      it->second[q] += amount;
      return absl::OkStatus();
    }
  }
  refused_[q].fetch_add(1, std::memory_order_relaxed);
  // With auth off the owner holds a peer address the client chose in part:
  // escaped, like everything peer-controlled that may reach a log.
  return absl::ResourceExhaustedError(absl::StrCat(
      "quota ", QuotaName(quota), " exceeded for ", absl::CHexEscape(owner),
      ": ", used, " in use, ", amount, " more asked, limit ", limit, " (",
      QuotaFlag(quota), "); ", Advice(quota)));
}

void Quotas::Give(absl::string_view owner, Quota quota, uint64_t amount) {
  if (owner.empty() || amount == 0) return;
  const size_t q = Index(quota);
  absl::MutexLock lock(&mu_);
  auto it = used_.find(owner);
  if (it == used_.end()) return;
  uint64_t& used = it->second[q];
  used = amount < used ? used - amount : 0;
  for (uint64_t u : it->second) {
    if (u != 0) return;
  }
  // An owner holding nothing takes no memory: connections' owners come and
  // go with their peers' ports.
  used_.erase(it);
}

uint64_t Quotas::Used(absl::string_view owner, Quota quota) const {
  absl::MutexLock lock(&mu_);
  auto it = used_.find(owner);
  return it == used_.end() ? 0 : it->second[Index(quota)];
}

QuotaStats Quotas::stats() const {
  QuotaStats stats;
  for (size_t q = 0; q < kNumQuotas; ++q) {
    stats.refused[q] = refused_[q].load(std::memory_order_relaxed);
  }
  absl::MutexLock lock(&mu_);
  stats.owners = used_.size();
  for (const auto& [owner, used] : used_) {
    for (size_t q = 0; q < kNumQuotas; ++q) stats.used[q] += used[q];
  }
  return stats;
}

absl::StatusOr<QuotaCharge> Quotas::Charge(
    absl::string_view owner,
    std::initializer_list<std::pair<Quota, uint64_t>> amounts) {
  QuotaCharge charge;
  if (owner.empty()) return charge;
  charge.quotas_ = this;
  charge.owner_ = std::string(owner);
  for (const auto& [quota, amount] : amounts) {
    // On a refusal `charge` gives back what it took so far.
    if (absl::Status s = Take(owner, quota, amount); !s.ok()) return s;
    charge.amounts_[Index(quota)] += amount;
  }
  return charge;
}

QuotaCharge::QuotaCharge(QuotaCharge&& other) noexcept
    : quotas_(other.quotas_),
      owner_(std::move(other.owner_)),
      amounts_(other.amounts_) {
  other.quotas_ = nullptr;
}

QuotaCharge& QuotaCharge::operator=(QuotaCharge&& other) noexcept {
  if (this != &other) {
    Release();
    quotas_ = other.quotas_;
    owner_ = std::move(other.owner_);
    amounts_ = other.amounts_;
    other.quotas_ = nullptr;
  }
  return *this;
}

void QuotaCharge::Release() {
  if (quotas_ == nullptr) return;
  for (size_t q = 0; q < kNumQuotas; ++q) {
    quotas_->Give(owner_, static_cast<Quota>(q), amounts_[q]);
  }
  quotas_ = nullptr;
}

std::string QuotaOwner(const Grant* grant, absl::string_view peer) {
  if (grant == nullptr) return absl::StrCat("connection ", peer);
  if (grant->admin()) return "";
  // Tokens recorded before issuers were kept have no root: each is its own
  // tenant until reissued.
  const std::string& digest =
      grant->root_digest.empty() ? grant->digest : grant->root_digest;
  return absl::StrCat("token ", absl::string_view(digest).substr(0, 12));
}

std::vector<store::Share> TenantShares(absl::Span<const FileToken> tokens) {
  std::vector<store::Share> shares;
  for (const FileToken& token : tokens) {
    if (token.grant.role != v1::READ_WRITE) continue;
    Grant grant = token.grant;
    grant.digest = token.digest;
    grant.root_digest = token.digest;
    store::Share share{.name = QuotaOwner(&grant, ""), .roots = {grant.prefix}};
    for (absl::string_view ns : kRunNamespaces) {
      share.roots.push_back(absl::StrCat(ns, grant.prefix));
    }
    shares.push_back(std::move(share));
  }
  return shares;
}

absl::Status SetTenantShares(const std::string& tokens_file,
                             store::KvStore& store) {
  std::ifstream in(tokens_file);
  if (!in.is_open()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot read the tokens file ", tokens_file));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<std::vector<FileToken>> tokens =
      ParseTokensFile(text.str(), tokens_file);
  if (!tokens.ok()) return tokens.status();
  return store.SetShares(TenantShares(*tokens));
}

}  // namespace cohort::server

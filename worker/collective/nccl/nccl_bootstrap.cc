#include "worker/collective/nccl/nccl_bootstrap.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace cohort {

std::vector<int> NcclRootRanks(int size, int ranks_per_root) {
  const int roots = (size + ranks_per_root - 1) / ranks_per_root;
  const int stride = (size + roots - 1) / roots;
  std::vector<int> ranks;
  for (int i = 0; i < roots && i * stride < size; ++i) {
    ranks.push_back(i * stride);
  }
  return ranks;
}

std::string NcclUniqueIdKey(absl::string_view comm, int root_index) {
  return absl::StrCat(comm, "/unique_id/", root_index);
}

std::string NcclArrivedKey(absl::string_view comm, int rank) {
  return absl::StrCat(comm, "/arrived/", rank);
}

absl::StatusOr<std::vector<NcclUniqueId>> ExchangeNcclUniqueIds(
    NcclApi& api, Store& store, absl::string_view comm, int rank, int size,
    int ranks_per_root, absl::Time deadline) {
  const std::vector<int> roots = NcclRootRanks(size, ranks_per_root);
  std::vector<std::string> keys;
  for (size_t i = 0; i < roots.size(); ++i) {
    keys.push_back(NcclUniqueIdKey(comm, static_cast<int>(i)));
  }
  const auto root = std::find(roots.begin(), roots.end(), rank);
  if (root != roots.end()) {
    absl::StatusOr<NcclUniqueId> id = api.GetUniqueId();
    if (!id.ok()) return id.status();
    absl::Status published =
        store.Set(keys[root - roots.begin()],
                  absl::string_view(id->bytes.data(), id->bytes.size()));
    if (!published.ok()) return published;
  }
  absl::Status arrived = store.Set(NcclArrivedKey(comm, rank), "1");
  if (!arrived.ok()) return arrived;

  absl::StatusOr<std::vector<std::string>> values = store.MultiGet(
      keys, std::max(deadline - absl::Now(), absl::ZeroDuration()));
  if (values.status().code() == absl::StatusCode::kDeadlineExceeded) {
    std::vector<std::string> missing;
    for (size_t i = 0; i < roots.size(); ++i) {
      absl::StatusOr<bool> there = store.Check({keys[i]});
      if (there.ok() && !*there) {
        missing.push_back(absl::StrCat("rank ", roots[i], " (root ", i, " of ",
                                       roots.size(), ", key '", keys[i], "')"));
      }
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "the NCCL unique id of communicator '", comm, "' was not published by ",
        missing.empty() ? "every root" : absl::StrJoin(missing, ", "),
        " by the deadline: ", values.status().message()));
  }
  if (!values.ok()) return values.status();
  std::vector<NcclUniqueId> ids(roots.size());
  for (size_t i = 0; i < roots.size(); ++i) {
    const std::string& value = (*values)[i];
    if (value.size() != kNcclUniqueIdBytes) {
      return absl::DataLossError(absl::StrCat(
          "key '", keys[i], "' holds ", value.size(), " bytes, not an ",
          kNcclUniqueIdBytes, "-byte NCCL unique id (another program's key?)"));
    }
    std::copy(value.begin(), value.end(), ids[i].bytes.begin());
  }
  return ids;
}

std::vector<int> NcclMissingRanks(Store& store, absl::string_view comm,
                                  int size) {
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    absl::StatusOr<bool> there = store.Check({NcclArrivedKey(comm, r)});
    if (!there.ok()) return {};
    if (!*there) missing.push_back(r);
  }
  return missing;
}

}  // namespace cohort

#include "worker/collective/init/backend_factory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/collective/nccl/nccl_backend.h"

namespace cohort {

absl::Status CheckBackend(absl::string_view backend) {
  if (backend != "gloo" && backend != "nccl") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown backend '", backend, "': this build has gloo and nccl"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateProcessGroup(
    absl::string_view backend, std::shared_ptr<Store> store, int rank, int size,
    const InitOptions& options) {
  if (absl::Status known = CheckBackend(backend); !known.ok()) return known;
  if (backend == "nccl") {
    NcclOptions nccl = options.nccl;
    nccl.group = options.group;
    absl::StatusOr<std::unique_ptr<NcclProcessGroup>> group =
        CreateNcclProcessGroup(std::move(store), rank, size, nccl);
    if (!group.ok()) return group.status();
    return std::unique_ptr<ProcessGroup>(std::move(*group));
  }
  GlooOptions gloo = options.gloo;
  gloo.group = options.group;
  absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
      GlooProcessGroup::Create(std::move(store), rank, size, gloo);
  if (!group.ok()) return group.status();
  return std::unique_ptr<ProcessGroup>(std::move(*group));
}

}  // namespace cohort

// CreateGlooGroup in this binary, over Debian's libgloo (gloo_group.h says
// which module links it in and which loads it): the backend factory's
// "gloo" group, as any user creates it.
#include "worker/torch/gloo_group.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gloo/transport/tcp/device.h"
#include "worker/collective/init/backend_factory.h"

namespace cohort {

absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateGlooGroup(
    std::shared_ptr<Store> store, int rank, int size, absl::Duration timeout) {
  InitOptions options;
  options.group.timeout = timeout;
  options.gloo.store_prefix = "cohort";
  // torch's knob for the interface Gloo listens on, honoured the same way.
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    std::vector<std::string> names = absl::StrSplit(ifname, ',');
    options.gloo.interface = names[0];
  }
  if (const char* verify = std::getenv("COHORT_VERIFY_OPS")) {
    options.group.verify_ops = std::string(verify) != "0";
  }
  // Ranks of one host share memory unless COHORT_SHARED_MEMORY=0;
  // COHORT_HOST_ID (read by the Gloo backend) says which host a rank is on.
  if (const char* shm = std::getenv("COHORT_SHARED_MEMORY")) {
    options.gloo.shm.enabled = std::string(shm) != "0";
  }
  return CreateProcessGroup("gloo", std::move(store), rank, size, options);
}

namespace {

absl::StatusOr<std::string> FileOf(const void* address, const char* what) {
  Dl_info info;
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("dladdr finds no loaded file holding ", what));
  }
  return std::string(info.dli_fname);
}

}  // namespace

absl::StatusOr<GlooBinding> FindGlooBinding() {
  // Taking a function's address in position-independent code reads it from
  // this file's GOT: the definition the dynamic linker bound the name to.
  using CreateDevice = std::shared_ptr<gloo::transport::Device> (*)(
      const gloo::transport::tcp::attr&);
  const CreateDevice create_device = &gloo::transport::tcp::CreateDevice;
  absl::StatusOr<std::string> gloo =
      FileOf(reinterpret_cast<const void*>(create_device),
             "gloo::transport::tcp::CreateDevice");
  if (!gloo.ok()) return gloo.status();
  absl::StatusOr<std::string> group = FileOf(
      reinterpret_cast<const void*>(&CreateGlooGroup), "CreateGlooGroup");
  if (!group.ok()) return group.status();
  return GlooBinding{*std::move(group), *std::move(gloo)};
}

}  // namespace cohort

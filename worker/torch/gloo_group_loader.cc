// CreateGlooGroup for the PyTorch 2.x module: loads libcohort_gloo.so from
// the module's folder, apart from torch's own Gloo (gloo_group.h says why),
// and calls it.
#include <dlfcn.h>

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/torch/gloo_group.h"

namespace cohort {
namespace {

constexpr char kLibrary[] = "libcohort_gloo.so";

struct Library {
  absl::Status status;  // Why it could not be loaded.
  CreateGlooGroupEntry create = nullptr;
  FindGlooBindingEntry find = nullptr;
};

// The folder of the file this function is in: the module's.
absl::StatusOr<std::string> ThisFolder() {
  Dl_info info;
  if (dladdr(reinterpret_cast<const void*>(&ThisFolder), &info) == 0 ||
      info.dli_fname == nullptr) {
    return absl::NotFoundError("dladdr cannot find the module's own file");
  }
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

Library Open() {
  Library library;
  absl::StatusOr<std::string> folder = ThisFolder();
  if (!folder.ok()) {
    library.status = folder.status();
    return library;
  }
  const std::string path = absl::StrCat(*folder, "/", kLibrary);
  // RTLD_DEEPBIND: the library and what it loads (libgloo) look up symbols
  // in their own dependency tree first, so that torch's Gloo cannot stand in
  // for Debian's even where torch's symbols are global. RTLD_LOCAL: nothing
  // else binds to theirs.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (handle == nullptr) {
    library.status = absl::NotFoundError(
        absl::StrCat("cannot load cohort's Gloo group library ", path,
                     " (it is built beside the module): ", dlerror()));
    return library;
  }
  library.create = reinterpret_cast<CreateGlooGroupEntry>(
      dlsym(handle, kCreateGlooGroupEntry));
  library.find = reinterpret_cast<FindGlooBindingEntry>(
      dlsym(handle, kFindGlooBindingEntry));
  if (library.create == nullptr || library.find == nullptr) {
    library.status = absl::NotFoundError(
        absl::StrCat(path, " lacks ", kCreateGlooGroupEntry, " or ",
                     kFindGlooBindingEntry, ": not cohort's library?"));
  }
  // Never closed: the groups it makes and their threads live in it.
  return library;
}

const Library& Loaded() {
  static const Library* const library = new Library(Open());
  return *library;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateGlooGroup(
    std::shared_ptr<Store> store, int rank, int size, absl::Duration timeout) {
  const Library& library = Loaded();
  if (!library.status.ok()) return library.status;
  GlooGroupRequest request;
  request.store = std::move(store);
  request.rank = rank;
  request.size = size;
  request.timeout = timeout;
  absl::StatusOr<std::unique_ptr<ProcessGroup>> result =
      absl::UnknownError("libcohort_gloo.so returned nothing");
  library.create(&request, &result);
  return result;
}

absl::StatusOr<GlooBinding> FindGlooBinding() {
  const Library& library = Loaded();
  if (!library.status.ok()) return library.status;
  absl::StatusOr<GlooBinding> result =
      absl::UnknownError("libcohort_gloo.so returned nothing");
  library.find(&result);
  return result;
}

}  // namespace cohort

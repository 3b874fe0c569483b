// CreateGlooGroup: the cohort group under the torch backend "cohort", the
// backend factory's "gloo" group (worker/collective/init/backend_factory.h)
// configured from the environment the way torch users configure torch's own
// gloo backend.
//
// Two implementations, one per torch:
//  - gloo_group.cc creates the group in this binary, linked against
//    Debian's libgloo. The PyTorch 1.13 module does this: Debian's libtorch
//    1.13 links the same libgloo, so a process has one Gloo.
//  - gloo_group_loader.cc (the PyTorch 2.x module) loads libcohort_gloo.so,
//    which holds gloo_group.cc and everything under it (the backend
//    factory and the backends), from the module's folder, and calls it
//    (the factory runs inside it). Why: torch 2.x wheels carry their own, newer
//    Gloo inside libtorch_cpu.so, with its functions exported (340 symbols of
//    namespace gloo in 2.11), unversioned, under the same mangled names as
//    Debian's libgloo. The dynamic linker binds each name to the first
//    definition it finds, and the module links libtorch_cpu.so, so calls meant
//    for Debian's Gloo, even libgloo's calls to itself and its vtables, could
//    land in torch's copy, whose classes have other layouts. The library is
//    opened with RTLD_DEEPBIND, so that it and libgloo find their own
//    symbols before anything else in the process, even where torch's are
//    global (TORCH_USE_RTLD_GLOBAL=1); it exports only the entry points
//    below, and the module itself links no Gloo at all. torch's gloo
//    backend keeps its own, as before.
#ifndef COHORT_WORKER_TORCH_GLOO_GROUP_H_
#define COHORT_WORKER_TORCH_GLOO_GROUP_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/store.h"
#include "worker/collective/process_group.h"

namespace cohort {

// Connects rank `rank` of `size` through `store`; blocks until every rank
// has arrived or `timeout` passes, which then bounds every op. Read from
// the environment: GLOO_SOCKET_IFNAME (the first interface named; torch's
// knob), COHORT_VERIFY_OPS=0 (no cross-rank check of each op),
// COHORT_SHARED_MEMORY=0 (TCP between ranks of one host too) and
// COHORT_HOST_ID (which ranks share a host; GlooOptions::shm.host_id).
absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateGlooGroup(
    std::shared_ptr<Store> store, int rank, int size, absl::Duration timeout);

// Which files the dynamic linker took cohort's Gloo group from, as paths:
// the one holding CreateGlooGroup's code, and the one that defines the
// gloo functions that code calls (Debian's libgloo.so.0 unless something
// interposed; the tests check it is not torch's libtorch_cpu.so).
struct GlooBinding {
  std::string group_library;
  std::string gloo_library;
};
absl::StatusOr<GlooBinding> FindGlooBinding();

// libcohort_gloo.so's entry points (C names, for dlsym), as the 2.x module
// calls them; each fills `*result`.
struct GlooGroupRequest {
  std::shared_ptr<Store> store;
  int rank = 0;
  int size = 0;
  absl::Duration timeout;
};
using CreateGlooGroupEntry =
    void (*)(const GlooGroupRequest* request,
             absl::StatusOr<std::unique_ptr<ProcessGroup>>* result);
using FindGlooBindingEntry = void (*)(absl::StatusOr<GlooBinding>* result);
inline constexpr char kCreateGlooGroupEntry[] = "cohort_create_gloo_group";
inline constexpr char kFindGlooBindingEntry[] = "cohort_find_gloo_binding";

}  // namespace cohort

#endif  // COHORT_WORKER_TORCH_GLOO_GROUP_H_

// libcohort_gloo.so's entry points (gloo_group.h): cohort's Gloo group,
// loaded by the PyTorch 2.x module apart from torch's own Gloo. The
// library's version script (gloo_library.lds) exports these two and
// nothing else.
#include <exception>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/torch/gloo_group.h"

namespace {

absl::Status Threw(const char* call) {
  try {
    throw;
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(call, " threw: ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(call, " threw"));
  }
}

}  // namespace

extern "C" void cohort_create_gloo_group(
    const cohort::GlooGroupRequest* request,
    absl::StatusOr<std::unique_ptr<cohort::ProcessGroup>>* result) {
  try {
    *result = cohort::CreateGlooGroup(request->store, request->rank,
                                      request->size, request->timeout);
  } catch (...) {
    *result = Threw("CreateGlooGroup");
  }
}

extern "C" void cohort_find_gloo_binding(
    absl::StatusOr<cohort::GlooBinding>* result) {
  try {
    *result = cohort::FindGlooBinding();
  } catch (...) {
    *result = Threw("FindGlooBinding");
  }
}

// The module calls these through pointers of these types.
static_assert(std::is_same_v<decltype(&cohort_create_gloo_group),
                             cohort::CreateGlooGroupEntry>);
static_assert(std::is_same_v<decltype(&cohort_find_gloo_binding),
                             cohort::FindGlooBindingEntry>);

// A token's role as people write it (the tokens file, cohortctl, logs):
// "r", "rw", "admin". One spelling for cohortd and its clients.
#ifndef COHORT_PROTO_AUTH_ROLES_H_
#define COHORT_PROTO_AUTH_ROLES_H_

#include <optional>

#include "absl/strings/string_view.h"
#include "cohort/v1/auth.pb.h"

namespace cohort::auth {

// "r", "rw", "admin", or "none" for ROLE_UNSPECIFIED.
const char* RoleName(v1::Role role);

// The role spelled `name`, or nullopt.
std::optional<v1::Role> ParseRole(absl::string_view name);

}  // namespace cohort::auth

#endif  // COHORT_PROTO_AUTH_ROLES_H_

#include "proto/auth/roles.h"

namespace cohort::auth {

const char* RoleName(v1::Role role) {
  switch (role) {
    case v1::READ:
      return "r";
    case v1::READ_WRITE:
      return "rw";
    case v1::ADMIN:
      return "admin";
    default:
      return "none";
  }
}

std::optional<v1::Role> ParseRole(absl::string_view name) {
  for (v1::Role role : {v1::READ, v1::READ_WRITE, v1::ADMIN}) {
    if (name == RoleName(role)) return role;
  }
  return std::nullopt;
}

}  // namespace cohort::auth

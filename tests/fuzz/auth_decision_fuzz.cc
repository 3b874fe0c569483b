// auth_decision_fuzz: cohortd's authorization decision (server/auth/auth.h's
// Covers, CoversKey, CheckAccess and NarrowPrefix) checked against a model
// written from the rules users are promised (proto/cohort/v1/auth.proto and
// docs/security.md's Tokens section), not from auth.cc.
//
// The input picks a grant (r, rw or admin), then names: listing prefixes
// and keys, most of them the grant's prefix edited the way one job's name
// turns into a sibling's (a character added or cut, a '/' added or cut, a
// run namespace or "/cohort/" put in front). Beside them every input checks
// a fixed family of siblings around the grant's prefix, each requested
// prefix and what it was narrowed to.
//
// The model, as the docs state it:
// - a name (run, group) is within P when it starts with P, or P ends in
//   '/' and the name is P without it; "*" (an admin's) reaches everything;
// - a key is within P when it is a name within P, or a name within
//   "/cohortrun/" + P or "runs/" + P (the keys of P's runs);
// - a read needs the name within the grant, a write also a role other
//   than r; a refusal is PERMISSION_DENIED naming the prefix, with the
//   caller's text escaped;
// - a listing prefix is a set of keys, and is narrowed to lie under one of
//   the grant's key roots (P, "/cohortrun/" + P, "runs/" + P): unchanged
//   when it already lies under one; cut to P when it is wider and P starts
//   with it, else to the one run-namespace root that starts with it;
//   PERMISSION_DENIED when no root meets it. An admin's is never changed.
//
// NarrowPrefix's result N for a requested prefix R is also checked on the
// keys themselves, before it is compared with the model's:
// - N starts with R: a listing never gets more than was asked;
// - soundness: every key of the set that starts with N is a key within the
//   grant, and N lies under one of the grant's key roots, so no key at all
//   outside the grant starts with N;
// - completeness, where the docs promise it: every key of the set that
//   starts with R and lies under the docs' answer (R itself when R lies
//   under a root, else the root R is cut to) starts with N; a refusal
//   withholds no key that lies under both R and a root.
// Not promised, so not checked: the bare names ("job1" for "job1/", which
// a key read reaches but a listing never does) and the roots a wide R
// reaches besides the one it is cut to (R = "" reaches "runs/" + P too,
// but is cut to P).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cohort/v1/auth.pb.h"
#include "server/auth/auth.h"
#include "tests/fuzz/fuzz_input.h"

namespace cohort::server {
namespace {

using fuzz::FuzzInput;

// The two run namespaces, as the docs name them (deliberately not
// kRunNamespaces: a change there is a change of the promise).
const char* const kModelNamespaces[] = {"/cohortrun/", "runs/"};

// The grant being checked, printed with any failure.
std::string current_grant;

std::string Q(absl::string_view s) {
  return absl::StrCat("\"", absl::CHexEscape(s), "\"");
}

std::string Show(bool b) { return b ? "true" : "false"; }
std::string Show(const absl::Status& s) { return s.ToString(); }
std::string Show(const absl::StatusOr<std::string>& s) {
  return s.ok() ? Q(*s) : s.status().ToString();
}
std::string Show(const std::optional<std::string>& s) {
  return s.has_value() ? Q(*s) : "PERMISSION_DENIED";
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "auth_decision_fuzz: %s\n  grant: %s\n", what.c_str(),
               current_grant.c_str());
  std::abort();
}

// Where auth.cc and the model disagree: both answers.
#define MODEL_AGREE(call, actual, expected)                    \
  do {                                                         \
    if ((actual) != (expected)) {                              \
      Fail(absl::StrCat(call, ": auth.cc says ", Show(actual), \
                        ", the model says ", Show(expected))); \
    }                                                          \
  } while (0)

#define MODEL_CHECK(cond, ...)                                   \
  do {                                                           \
    if (!(cond)) Fail(absl::StrCat(#cond, ": ", ##__VA_ARGS__)); \
  } while (0)

bool Starts(absl::string_view s, absl::string_view prefix) {
  return s.size() >= prefix.size() && s.substr(0, prefix.size()) == prefix;
}

// What a grant reaches, as sets: every string starting with one of
// `roots`, each of `exact`, or (admin) everything.
struct Reach {
  bool all = false;
  std::vector<std::string> roots;
  std::vector<std::string> exact;

  bool Has(absl::string_view name) const {
    if (all) return true;
    for (const std::string& root : roots) {
      if (Starts(name, root)) return true;
    }
    for (const std::string& e : exact) {
      if (name == e) return true;
    }
    return false;
  }
};

// The names within `prefix` (as a name prefix), added to `reach`.
void AddNamesWithin(const std::string& prefix, Reach& reach) {
  reach.roots.push_back(prefix);
  if (!prefix.empty() && prefix.back() == '/') {
    reach.exact.push_back(prefix.substr(0, prefix.size() - 1));
  }
}

Reach NamesOf(const Grant& grant) {
  Reach reach;
  if (grant.prefix == "*") {
    reach.all = true;
  } else {
    AddNamesWithin(grant.prefix, reach);
  }
  return reach;
}

// roots[0] is P itself, then one root per run namespace, in
// kModelNamespaces' order.
Reach KeysOf(const Grant& grant) {
  Reach reach = NamesOf(grant);
  if (!reach.all) {
    for (const char* space : kModelNamespaces) {
      AddNamesWithin(absl::StrCat(space, grant.prefix), reach);
    }
  }
  return reach;
}

// The docs' narrowing of a listing prefix, for a grant whose keys are
// `keys`; nullopt for PERMISSION_DENIED.
std::optional<std::string> ModelNarrow(const Reach& keys,
                                       const std::string& requested) {
  if (keys.all) return requested;
  for (const std::string& root : keys.roots) {
    if (Starts(requested, root)) return requested;
  }
  const std::string& own = keys.roots[0];
  if (Starts(own, requested)) return own;
  std::optional<std::string> reached;
  for (size_t i = 1; i < keys.roots.size(); ++i) {
    if (!Starts(keys.roots[i], requested)) continue;
    // Two namespace roots start with `requested` only if it is empty, and
    // then P does too.
    MODEL_CHECK(!reached.has_value(), "model: ", Q(requested),
                " reaches two namespace roots but not ", Q(own));
    reached = keys.roots[i];
  }
  return reached;
}

// The grant under test and what the model says it reaches.
struct Subject {
  Grant grant;
  Reach names;
  Reach keys;
};

bool HasControlBytes(absl::string_view s) {
  for (char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) return true;
  }
  return false;
}

bool HasHighBytes(absl::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return true;
  }
  return false;
}

// A refusal is PERMISSION_DENIED naming the prefix; the caller's text in it
// is escaped (the grant's own prefix, written by an operator, holds no
// control bytes but may hold UTF-8). `call` says what was called.
template <typename CallFn>
void CheckRefusal(const CallFn& call, const Grant& grant,
                  const absl::Status& status) {
  MODEL_CHECK(status.code() == absl::StatusCode::kPermissionDenied, call(),
              " refused with ", Show(status));
  MODEL_CHECK(absl::StrContains(status.message(), grant.prefix), call(),
              " refused without naming the prefix: ", Show(status));
  MODEL_CHECK(!HasControlBytes(status.message()), call(),
              " refused with unescaped control bytes: ", Q(status.message()));
  MODEL_CHECK(HasHighBytes(grant.prefix) || !HasHighBytes(status.message()),
              call(), " refused with unescaped bytes: ", Q(status.message()));
}

// Covers, CoversKey and CheckAccess on one name.
void CheckName(const Subject& subject, const std::string& name) {
  const Grant& grant = subject.grant;
  MODEL_AGREE(absl::StrCat("Covers(", Q(grant.prefix), ", ", Q(name), ")"),
              Covers(grant.prefix, name), subject.names.Has(name));
  MODEL_AGREE(absl::StrCat("CoversKey(", Q(grant.prefix), ", ", Q(name), ")"),
              CoversKey(grant.prefix, name), subject.keys.Has(name));
  for (const char* what : {"key", "run", "group"}) {
    const bool within = absl::string_view(what) == "key"
                            ? subject.keys.Has(name)
                            : subject.names.Has(name);
    for (Access access : {Access::kRead, Access::kWrite}) {
      const bool allowed =
          within && (access == Access::kRead || grant.role != v1::READ);
      auto call = [&] {
        return absl::StrCat("CheckAccess(", what, " ", Q(name), ", ",
                            access == Access::kRead ? "read" : "write", ")");
      };
      const absl::Status status = CheckAccess(grant, what, name, access);
      MODEL_AGREE(call(), status.ok(), allowed);
      if (!status.ok()) CheckRefusal(call, grant, status);
    }
  }
}

// NarrowPrefix for `requested`, against the model and on `keys`.
void CheckNarrow(const Subject& subject, const std::string& requested,
                 const std::vector<std::string>& keys) {
  auto call = [&] { return absl::StrCat("NarrowPrefix(", Q(requested), ")"); };
  const Grant& grant = subject.grant;
  const Reach& reach = subject.keys;
  const absl::StatusOr<std::string> narrowed = NarrowPrefix(grant, requested);
  const std::optional<std::string> expected = ModelNarrow(reach, requested);
  if (!narrowed.ok()) {
    if (expected.has_value()) {
      Fail(absl::StrCat(call(), ": auth.cc says ", Show(narrowed),
                        ", the model says ", Show(expected)));
    }
    CheckRefusal(call, grant, narrowed.status());
    // Disjoint: nothing the refusal withholds was listable.
    for (const std::string& key : keys) {
      if (!Starts(key, requested)) continue;
      for (const std::string& root : reach.roots) {
        MODEL_CHECK(!Starts(key, root), call(), " refused, but ", Q(key),
                    " is under both it and the root ", Q(root));
      }
    }
    return;
  }
  const std::string& n = *narrowed;
  MODEL_CHECK(Starts(n, requested), call(), " widened to ", Q(n));
  for (const std::string& key : keys) {
    if (Starts(key, n)) {
      MODEL_CHECK(reach.Has(key), call(), " = ", Q(n), " lists ", Q(key),
                  ", a key outside the grant");
    }
  }
  // The same for every key, not only the set's: the keys starting with N
  // are all within the grant only if N lies under one of its key roots.
  bool under_root = reach.all;
  for (const std::string& root : reach.roots) under_root |= Starts(n, root);
  MODEL_CHECK(under_root, call(), " = ", Q(n),
              ", which lies under none of the grant's key roots, so it "
              "matches keys outside the grant");
  // The keys promised: all under `requested` if it lies under a root,
  // else all under the root the docs cut it to (`expected` either way).
  if (expected.has_value()) {
    for (const std::string& key : keys) {
      if (Starts(key, requested) && Starts(key, *expected)) {
        MODEL_CHECK(Starts(key, n), call(), " = ", Q(n), " loses ", Q(key),
                    ", which the docs say it lists");
      }
    }
  }
  if (!expected.has_value() || n != *expected) {
    Fail(absl::StrCat(call(), ": auth.cc says ", Show(narrowed),
                      ", the model says ", Show(expected)));
  }
}

// Bytes a prefix may hold: none of the control bytes a grant's prefix is
// refused for.
std::string Printable(std::string s) {
  for (char& c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) c = static_cast<char>('a' + u % 26);
  }
  return s;
}

// Grant prefixes: job names with and without '/', short and empty-ish
// ones, ones inside a run namespace or cohortd's own.
std::string GrantPrefix(FuzzInput& in) {
  static const char* const kPrefixes[] = {
      "job1/",    "jobA/",     "team-a.",     "job1", "j",
      "/",        "runs/",     "/cohortrun/", "a/b/", "runs/job1/",
      "/cohort/", "job1.llm-", "r",           "",     "\xc3\xa9t\xc3\xa9/"};
  constexpr size_t kCount = sizeof(kPrefixes) / sizeof(kPrefixes[0]);
  size_t pick = in.Pick(kCount + 2);
  std::string prefix =
      pick < kCount ? kPrefixes[pick] : Printable(in.Bytes(12));
  switch (in.Pick(4)) {
    case 1:
      prefix += '/';
      break;
    case 2:
      if (!prefix.empty()) prefix.pop_back();
      break;
    default:
      break;
  }
  return prefix;
}

// A name: mostly the grant's prefix, edited toward a sibling's.
std::string Name(FuzzInput& in, const std::string& base) {
  static const char* const kWords[] = {
      "",           "job",          "job1",
      "job10/",     "jobAB/secret", "runs",
      "/cohortrun", "/cohort",      "/cohort/auth/tokens/x",
      "*"};
  static const char* const kFronts[] = {"/cohortrun/", "runs/",
                                        "/cohort/",    "/cohort/runs/",
                                        "/cohortrun",  "runs"};
  static const char kChars[] = {'/', 'B', '.', '0', '-', 'x', '\0', '\xff'};
  std::string s;
  switch (in.Pick(5)) {
    case 1:
      s = kWords[in.Pick(sizeof(kWords) / sizeof(kWords[0]))];
      break;
    case 2:
      s = in.Bytes(12);
      break;
    default:
      s = base;
      break;
  }
  for (size_t edits = in.Pick(4); edits > 0; --edits) {
    switch (in.Pick(7)) {
      case 0:
        s += kChars[in.Pick(sizeof(kChars))];
        break;
      case 1:
        if (!s.empty()) s.pop_back();
        break;
      case 2:
        s = kFronts[in.Pick(sizeof(kFronts) / sizeof(kFronts[0]))] + s;
        break;
      case 3:
        s += '/';
        break;
      case 4:
        s += in.Bytes(6);
        break;
      case 5:
        if (!s.empty() && s.back() == '/') {
          s.pop_back();
        } else {
          s += '/';
        }
        break;
      default:
        s.resize(in.Pick(s.size() + 1));
        break;
    }
  }
  return s;
}

// Siblings of `s`: it extended, cut short, across '/', and under each
// namespace and "/cohort/".
void AddSiblings(const std::string& s, std::vector<std::string>& keys) {
  std::vector<std::string> near = {s,        s + "B",    s + "B/k",
                                   s + "/k", s + "\xff", s + ".other/k"};
  if (!s.empty()) {
    const std::string cut = s.substr(0, s.size() - 1);
    near.push_back(cut);
    near.push_back(cut + "B/k");
    near.push_back(cut + "/k");
  }
  for (const std::string& n : near) {
    keys.push_back(n);
    for (const char* front : {"/cohortrun/", "runs/", "/cohort/"}) {
      keys.push_back(absl::StrCat(front, n));
    }
  }
}

}  // namespace
}  // namespace cohort::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cohort::server;
  FuzzInput in(data, size);
  Grant grant;
  grant.source = "file line 7";
  switch (in.Pick(3)) {
    case 0:
      grant.role = cohort::v1::READ;
      break;
    case 1:
      grant.role = cohort::v1::READ_WRITE;
      break;
    default:
      grant.role = cohort::v1::ADMIN;
      break;
  }
  // An admin's prefix is "*"; its names still come from a job's prefix.
  const std::string base = GrantPrefix(in);
  grant.prefix = grant.admin() ? "*" : base;
  current_grant =
      absl::StrCat(cohort::v1::Role_Name(grant.role), " ", Q(grant.prefix));

  const Subject subject{
      .grant = grant, .names = NamesOf(grant), .keys = KeysOf(grant)};

  std::vector<std::string> requested = {Name(in, base)};
  for (size_t n = in.Pick(4); n > 0; --n) requested.push_back(Name(in, base));
  std::vector<std::string> keys = requested;
  for (size_t n = in.Pick(17); n > 0; --n) keys.push_back(Name(in, base));
  AddSiblings(base, keys);
  if (!base.empty() && base.back() == '/') {
    AddSiblings(base.substr(0, base.size() - 1), keys);
  }
  for (const std::string& r : requested) {
    AddSiblings(r, keys);
    if (absl::StatusOr<std::string> n = NarrowPrefix(grant, r); n.ok()) {
      AddSiblings(*n, keys);
    }
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());

  for (const std::string& key : keys) CheckName(subject, key);
  for (const std::string& r : requested) CheckNarrow(subject, r, keys);
  return 0;
}

// The records cohortd's state machines keep in its store (rendezvous runs,
// group members), read back when cohortd starts so that a restart keeps
// them.
#ifndef COHORT_SERVER_COORDINATION_RECORDS_H_
#define COHORT_SERVER_COORDINATION_RECORDS_H_

#include <string>

#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "store/kv_store.h"

namespace cohort::server {

// Calls `fn` with each key under `prefix`, in key order, less the prefix,
// and its value, listing a page at a time. A key whose value cannot be read
// (or that was deleted meanwhile) is skipped; a listing error ends the walk.
// Either way the state machine starts without those records, as it would
// without a store.
void ForEachRecord(
    store::KvStore& store, absl::string_view prefix,
    absl::FunctionRef<void(absl::string_view name, const std::string& value)>
        fn);

// ForEachRecord for records that are serialized protos of type Record;
// one that does not parse is skipped.
template <typename Record>
void LoadRecords(
    store::KvStore& store, absl::string_view prefix,
    absl::FunctionRef<void(absl::string_view name, Record& record)> fn) {
  ForEachRecord(store, prefix,
                [&](absl::string_view name, const std::string& value) {
                  Record record;
                  if (record.ParseFromString(value)) fn(name, record);
                });
}

}  // namespace cohort::server

#endif  // COHORT_SERVER_COORDINATION_RECORDS_H_

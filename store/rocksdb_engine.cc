// RocksDB layout: user key K is stored as "d" + K; the store revision lives
// under the meta key "m" as 8 bytes big-endian. A mutation batch and its
// revision go in one WriteBatch, so they land in the WAL together.
#include <memory>

#include "absl/strings/str_cat.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"
#include "absl/strings/match.h"
#include "store/kv_engine.h"

namespace cohort::store {
namespace {

constexpr char kDataPrefix = 'd';
constexpr char kRevisionKey[] = "m";

std::string DataKey(absl::string_view key) {
  std::string out;
  out.reserve(key.size() + 1);
  out.push_back(kDataPrefix);
  out.append(key.data(), key.size());
  return out;
}

std::string EncodeRevision(int64_t revision) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<char>(revision & 0xff);
    revision >>= 8;
  }
  return out;
}

int64_t DecodeRevision(absl::string_view bytes) {
  uint64_t v = 0;
  for (unsigned char c : bytes) v = (v << 8) | c;
  return static_cast<int64_t>(v);
}

absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("rocksdb ", what, ": ", s.ToString()));
}

class RocksDbEngine final : public KvEngine {
 public:
  RocksDbEngine(std::unique_ptr<rocksdb::DB> db, bool sync_writes)
      : db_(std::move(db)) {
    write_options_.sync = sync_writes;
  }

  ~RocksDbEngine() override {
    // Closing flushes nothing the WAL does not already hold; it only makes
    // the next open faster.
    db_->FlushWAL(/*sync=*/true).PermitUncheckedError();
    db_->Close().PermitUncheckedError();
  }

  absl::Status Load() {
    std::string value;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), kRevisionKey, &value);
    if (s.ok()) {
      revision_ = DecodeRevision(value);
    } else if (!s.IsNotFound()) {
      return FromRocks(s, "reading the revision");
    }
    std::unique_ptr<rocksdb::Iterator> it(
        db_->NewIterator(rocksdb::ReadOptions()));
    for (it->Seek(std::string(1, kDataPrefix));
         it->Valid() && it->key()[0] == kDataPrefix; it->Next()) {
      ++num_keys_;
    }
    return FromRocks(it->status(), "counting keys");
  }

  absl::string_view name() const override { return "rocksdb"; }

  absl::StatusOr<std::optional<std::string>> Get(
      absl::string_view key) const override {
    std::string value;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), DataKey(key), &value);
    if (s.IsNotFound()) return std::nullopt;
    if (!s.ok()) return FromRocks(s, "get");
    return value;
  }

  absl::Status Apply(absl::Span<const Mutation> mutations,
                     int64_t revision) override {
    rocksdb::WriteBatch batch;
    int64_t delta = 0;
    // Keys this batch already created or removed, so a key named twice in one
    // batch is counted once.
    std::vector<std::pair<absl::string_view, bool>> seen;
    for (const Mutation& m : mutations) {
      std::string key = DataKey(m.key);
      bool existed;
      auto prior = std::find_if(seen.begin(), seen.end(), [&](auto& p) {
        return p.first == m.key;
      });
      if (prior != seen.end()) {
        existed = prior->second;
      } else {
        std::string ignored;
        rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), key, &ignored);
        if (!s.ok() && !s.IsNotFound()) return FromRocks(s, "get");
        existed = s.ok();
        seen.emplace_back(m.key, existed);
        prior = seen.end() - 1;
      }
      if (m.kind == Mutation::Kind::kPut) {
        batch.Put(key, m.value);
        if (!existed) ++delta;
        prior->second = true;
      } else {
        batch.Delete(key);
        if (existed) --delta;
        prior->second = false;
      }
    }
    batch.Put(kRevisionKey, EncodeRevision(revision));
    if (absl::Status s = FromRocks(db_->Write(write_options_, &batch), "write");
        !s.ok()) {
      return s;
    }
    num_keys_ += delta;
    revision_ = revision;
    return absl::OkStatus();
  }

  int64_t revision() const override { return revision_; }

  int64_t NumKeys() const override { return num_keys_; }

  absl::StatusOr<std::vector<std::string>> ListKeys(
      absl::string_view prefix, absl::string_view start_after,
      size_t limit) const override {
    std::vector<std::string> keys;
    std::unique_ptr<rocksdb::Iterator> it(
        db_->NewIterator(rocksdb::ReadOptions()));
    const std::string data_prefix = DataKey(prefix);
    if (start_after > prefix) {
      it->Seek(DataKey(start_after));
      if (it->Valid() && absl::string_view(it->key().data(), it->key().size()).substr(1) == start_after) {
        it->Next();
      }
    } else {
      it->Seek(data_prefix);
    }
    for (; it->Valid() && keys.size() < limit; it->Next()) {
      absl::string_view k = absl::string_view(it->key().data(), it->key().size());
      if (!absl::StartsWith(k, data_prefix)) break;
      keys.emplace_back(k.substr(1));
    }
    if (absl::Status s = FromRocks(it->status(), "list"); !s.ok()) return s;
    return keys;
  }

  absl::Status Flush() override {
    if (absl::Status s = FromRocks(db_->FlushWAL(/*sync=*/true), "flush wal");
        !s.ok()) {
      return s;
    }
    return FromRocks(db_->Flush(rocksdb::FlushOptions()), "flush");
  }

 private:
  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::WriteOptions write_options_;
  int64_t revision_ = 0;
  int64_t num_keys_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvEngine>> OpenRocksDbEngine(
    const RocksDbOptions& options) {
  rocksdb::Options db_options;
  db_options.create_if_missing = true;
  // A coordinator's data is small and hot: keep the footprint modest.
  db_options.max_background_jobs = 2;
  db_options.write_buffer_size = 32 << 20;
  db_options.keep_log_file_num = 4;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, options.path, &raw);
  if (!s.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open RocksDB at '", options.path,
                     "': ", s.ToString()));
  }
  auto engine = std::make_unique<RocksDbEngine>(std::unique_ptr<rocksdb::DB>(raw),
                                                options.sync_writes);
  if (absl::Status st = engine->Load(); !st.ok()) return st;
  return engine;
}

}  // namespace cohort::store

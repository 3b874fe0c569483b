#include "worker/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

namespace cohort {
namespace {

absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  const int e = errno;
  std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(e));
  if (e == ENOSPC || e == EDQUOT) return absl::ResourceExhaustedError(message);
  if (e == ENOENT) return absl::NotFoundError(message);
  return absl::InternalError(message);
}

uint32_t Crc32(const void* data, size_t bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  // zlib takes a uInt length: feed it in pieces below 4 GiB.
  while (bytes > 0) {
    const uInt n = static_cast<uInt>(std::min<size_t>(bytes, 1u << 30));
    crc = crc32(crc, p, n);
    p += n;
    bytes -= n;
  }
  return static_cast<uint32_t>(crc);
}

absl::Status MakeFolder(const std::string& path) {
  if (mkdir(path.c_str(), 0755) == 0 || errno == EEXIST) return absl::OkStatus();
  return ErrnoError("cannot create the checkpoint folder", path);
}

absl::Status SyncPath(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open", path);
  const int synced = fsync(fd);
  close(fd);
  if (synced != 0) return ErrnoError("cannot fsync", path);
  return absl::OkStatus();
}

// Writes `bytes` to `path` durably: to path.tmp, fsync, rename over path,
// fsync of the folder. A crash leaves either the old file or the new one.
absl::Status WriteDurably(const std::string& folder, const std::string& name,
                          const char* data, size_t bytes) {
  const std::string path = absl::StrCat(folder, "/", name);
  const std::string tmp = absl::StrCat(path, ".tmp");
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("cannot create", tmp);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = write(fd, data + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status s = ErrnoError("cannot write", tmp);
      close(fd);
      unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    absl::Status s = ErrnoError("cannot fsync", tmp);
    close(fd);
    unlink(tmp.c_str());
    return s;
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return ErrnoError(absl::StrCat("cannot rename ", tmp, " to"), path);
  }
  return SyncPath(folder);
}

// One save's work once its shards are in `image`.
struct PendingSave {
  int64_t step = 0;
  std::string image;  // The data file's bytes.
  v1::CheckpointPart part;
};

}  // namespace

ElementRange EvenShard(uint64_t numel, int rank, int world) {
  const uint64_t per = (numel + world - 1) / world;
  const uint64_t start = std::min<uint64_t>(numel, per * rank);
  return {start, std::min<uint64_t>(numel, start + per) - start};
}

std::vector<FlatPiece> SplitFlatRange(const std::vector<size_t>& sizes,
                                      uint64_t start, uint64_t count) {
  std::vector<FlatPiece> pieces;
  const uint64_t end = start + count;
  uint64_t base = 0;  // Where tensor i begins in the concatenation.
  for (size_t i = 0; i < sizes.size(); base += sizes[i], ++i) {
    const uint64_t lo = std::max<uint64_t>(start, base);
    const uint64_t hi = std::min<uint64_t>(end, base + sizes[i]);
    if (lo >= hi) continue;
    pieces.push_back({static_cast<int>(i), lo - base, lo - start, hi - lo});
  }
  return pieces;
}

struct CheckpointWriter::State {
  CheckpointOptions options;

  absl::Mutex mu;
  absl::Status last ABSL_GUARDED_BY(mu);
  uint64_t bytes ABSL_GUARDED_BY(mu) = 0;
  double seconds ABSL_GUARDED_BY(mu) = 0;
  std::thread thread;

  absl::StatusOr<PendingSave> Prepare(
      int64_t step, const std::vector<ShardToSave>& shards,
      const std::map<std::string, std::string>& attributes) const;
  absl::Status Write(PendingSave& save) const;  // Fills the CRC-32s.
};

absl::StatusOr<PendingSave> CheckpointWriter::State::Prepare(
    int64_t step, const std::vector<ShardToSave>& shards,
    const std::map<std::string, std::string>& attributes) const {
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint step must be >= 0, got ", step));
  }
  PendingSave save;
  save.step = step;
  size_t total = 0;
  for (const ShardToSave& s : shards) total += s.data.size() * sizeof(float);
  save.image.resize(total);
  const std::string file = absl::StrFormat("rank-%05d.bin", options.rank);
  save.part.set_rank(options.rank);
  save.part.mutable_file()->set_name(file);
  save.part.mutable_file()->set_bytes(total);
  save.part.mutable_file()->set_rank(options.rank);
  if (options.rank == 0) {
    for (const auto& [k, v] : attributes) (*save.part.mutable_attributes())[k] = v;
  }
  size_t offset = 0;
  std::map<std::string, v1::CheckpointTensor*> tensors;
  for (const ShardToSave& s : shards) {
    uint64_t numel = 1;
    for (uint64_t d : s.shape) numel *= d;
    if (s.name.empty() || s.start + s.data.size() > numel) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint of step ", step, ": shard of tensor '", s.name,
          "' at elements ", s.start, "+", s.data.size(), " does not fit its ",
          numel, " elements"));
    }
    if (s.data.empty()) continue;
    v1::CheckpointTensor*& t = tensors[s.name];
    if (t == nullptr) {
      t = save.part.add_tensors();
      t->set_name(s.name);
      t->set_dtype("f32");
      for (uint64_t d : s.shape) t->add_shape(d);
    }
    const size_t bytes = s.data.size() * sizeof(float);
    std::memcpy(save.image.data() + offset, s.data.data(), bytes);
    v1::CheckpointShard* shard = t->add_shards();
    shard->set_file(file);
    shard->set_offset(offset);
    shard->set_start(s.start);
    shard->set_count(s.data.size());
    offset += bytes;  // Its CRC-32 is computed by Write, off the caller.
  }
  return save;
}

absl::Status CheckpointWriter::State::Write(PendingSave& save) const {
  CheckpointCatalog& catalog = *options.catalog;
  absl::StatusOr<bool> done = catalog.IsCommitted(save.step);
  if (!done.ok()) return done.status();
  if (*done) {
    return absl::AlreadyExistsError(absl::StrCat(
        "checkpoint of step ", save.step, " is already committed in ",
        catalog.prefix(), "; a checkpoint is never overwritten"));
  }
  for (v1::CheckpointTensor& t : *save.part.mutable_tensors()) {
    for (v1::CheckpointShard& shard : *t.mutable_shards()) {
      shard.set_crc32(Crc32(save.image.data() + shard.offset(),
                            shard.count() * sizeof(float)));
    }
  }
  const std::string folder =
      absl::StrCat(options.dir, "/", CheckpointFolderName(save.step));
  if (absl::Status s = MakeFolder(folder); !s.ok()) return s;
  if (absl::Status s = WriteDurably(folder, save.part.file().name(),
                                    save.image.data(), save.image.size());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = catalog.ReportPart(save.step, options.attempt, save.part);
      !s.ok()) {
    return s;
  }
  if (options.rank != 0) {
    return catalog.WaitCommitted(save.step, options.commit_timeout);
  }
  absl::StatusOr<std::vector<v1::CheckpointPart>> parts = catalog.WaitForParts(
      save.step, options.attempt, options.world_size, options.commit_timeout);
  if (!parts.ok()) return parts.status();
  absl::StatusOr<v1::CheckpointMetadata> metadata = MergeCheckpointParts(
      save.step, options.world_size, *std::move(parts), absl::Now());
  if (!metadata.ok()) return metadata.status();
  const std::string json = CheckpointMetadataToJson(*metadata);
  if (absl::Status s = WriteDurably(folder, "metadata.json", json.data(), json.size());
      !s.ok()) {
    return s;
  }
  v1::CheckpointRecord record;
  record.set_step(save.step);
  record.set_world_size(options.world_size);
  uint64_t bytes = 0;
  for (const v1::CheckpointFile& f : metadata->files()) bytes += f.bytes();
  record.set_bytes(bytes);
  record.set_created_unix_ms(metadata->created_unix_ms());
  record.set_path(folder);
  if (absl::Status s = catalog.Commit(record); !s.ok()) return s;
  return catalog.ForgetParts(save.step);
}

CheckpointWriter::CheckpointWriter(std::unique_ptr<State> state)
    : state_(std::move(state)) {}

CheckpointWriter::~CheckpointWriter() { Wait().IgnoreError(); }

absl::StatusOr<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Create(
    const CheckpointOptions& options) {
  if (options.dir.empty() || options.catalog == nullptr) {
    return absl::InvalidArgumentError(
        "a checkpoint writer needs a folder and the run's catalog");
  }
  if (options.world_size < 1 || options.rank < 0 ||
      options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint writer: rank ", options.rank, " of world size ",
        options.world_size));
  }
  if (absl::Status s = MakeFolder(options.dir); !s.ok()) return s;
  auto state = std::make_unique<State>();
  state->options = options;
  return std::unique_ptr<CheckpointWriter>(new CheckpointWriter(std::move(state)));
}

absl::Status CheckpointWriter::Save(
    int64_t step, const std::vector<ShardToSave>& shards,
    const std::map<std::string, std::string>& attributes) {
  if (absl::Status s = Wait(); !s.ok()) return s;
  const absl::Time start = absl::Now();
  absl::StatusOr<PendingSave> save = state_->Prepare(step, shards, attributes);
  if (!save.ok()) return save.status();
  absl::Status written = state_->Write(*save);
  absl::MutexLock lock(&state_->mu);
  if (written.ok()) state_->bytes += save->image.size();
  state_->seconds += absl::ToDoubleSeconds(absl::Now() - start);
  return written;
}

absl::Status CheckpointWriter::SaveAsync(
    int64_t step, const std::vector<ShardToSave>& shards,
    const std::map<std::string, std::string>& attributes) {
  if (absl::Status s = Wait(); !s.ok()) return s;
  absl::StatusOr<PendingSave> save = state_->Prepare(step, shards, attributes);
  if (!save.ok()) return save.status();
  State* state = state_.get();
  state_->thread = std::thread([state, save = *std::move(save)]() mutable {
    const absl::Time start = absl::Now();
    absl::Status written = state->Write(save);
    absl::MutexLock lock(&state->mu);
    if (written.ok()) state->bytes += save.image.size();
    state->seconds += absl::ToDoubleSeconds(absl::Now() - start);
    state->last = written;
  });
  return absl::OkStatus();
}

absl::Status CheckpointWriter::Wait() {
  if (state_->thread.joinable()) state_->thread.join();
  absl::MutexLock lock(&state_->mu);
  absl::Status last = state_->last;
  state_->last = absl::OkStatus();
  return last;
}

uint64_t CheckpointWriter::bytes_written() const {
  absl::MutexLock lock(&state_->mu);
  return state_->bytes;
}

double CheckpointWriter::seconds_writing() const {
  absl::MutexLock lock(&state_->mu);
  return state_->seconds;
}

CheckpointReader::CheckpointReader(std::string folder,
                                   v1::CheckpointMetadata metadata)
    : folder_(std::move(folder)), metadata_(std::move(metadata)) {
  for (int i = 0; i < metadata_.tensors_size(); ++i) {
    by_name_[metadata_.tensors(i).name()] = i;
  }
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    const std::string& folder) {
  const std::string path = absl::StrCat(folder, "/metadata.json");
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoError("cannot open the checkpoint's metadata", path);
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<v1::CheckpointMetadata> metadata =
      CheckpointMetadataFromJson(text.str());
  if (!metadata.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", metadata.status().message()));
  }
  return std::unique_ptr<CheckpointReader>(
      new CheckpointReader(folder, *std::move(metadata)));
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::OpenLatest(
    CheckpointCatalog& catalog) {
  absl::StatusOr<std::optional<v1::CheckpointRecord>> latest = catalog.Latest();
  if (!latest.ok()) return latest.status();
  if (!latest->has_value()) return std::unique_ptr<CheckpointReader>();
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      Open((*latest)->path());
  if (reader.ok() && (*reader)->step() != (*latest)->step()) {
    return absl::DataLossError(absl::StrCat(
        "the latest checkpoint, step ", (*latest)->step(), ", is at ",
        (*latest)->path(), " whose metadata.json says step ",
        (*reader)->step()));
  }
  return reader;
}

bool CheckpointReader::Has(absl::string_view name) const {
  return by_name_.find(name) != by_name_.end();
}

absl::StatusOr<uint64_t> CheckpointReader::Numel(absl::string_view name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) {
    return absl::NotFoundError(absl::StrCat("checkpoint of step ", step(),
                                            " has no tensor '", name, "'"));
  }
  return CheckpointNumel(metadata_.tensors(it->second));
}

absl::Status CheckpointReader::ReadShard(const v1::CheckpointTensor& tensor,
                                         const v1::CheckpointShard& shard,
                                         absl::Span<float> out) const {
  const std::string path = absl::StrCat(folder_, "/", shard.file());
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open the checkpoint's data file", path);
  char* bytes_out = reinterpret_cast<char*>(out.data());
  const size_t bytes = out.size() * sizeof(float);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n =
        pread(fd, bytes_out + done, bytes - done, shard.offset() + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status s = n < 0 ? ErrnoError("cannot read", path)
                             : absl::DataLossError(absl::StrCat(
                                   path, " ends before tensor '", tensor.name(),
                                   "''s shard at bytes ", shard.offset(), "+",
                                   bytes));
      close(fd);
      return s;
    }
    done += static_cast<size_t>(n);
  }
  close(fd);
  if (Crc32(bytes_out, bytes) != shard.crc32()) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint of step ", step(), ": tensor '", tensor.name(),
        "''s shard at bytes ", shard.offset(), "+", bytes, " of ", path,
        " fails its CRC-32 check: the file was changed or damaged"));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::Read(absl::string_view name, uint64_t start,
                                   absl::Span<float> out) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return Numel(name).status();
  const v1::CheckpointTensor& t = metadata_.tensors(it->second);
  const uint64_t end = start + out.size();
  if (end > CheckpointNumel(t)) {
    return absl::OutOfRangeError(absl::StrCat(
        "tensor '", name, "' has ", CheckpointNumel(t),
        " elements; elements ", start, "+", out.size(), " were asked for"));
  }
  for (const v1::CheckpointShard& s : t.shards()) {
    const uint64_t lo = std::max<uint64_t>(start, s.start());
    const uint64_t hi = std::min<uint64_t>(end, s.start() + s.count());
    if (lo >= hi) continue;
    if (lo == s.start() && hi == s.start() + s.count()) {
      // The whole shard is wanted: read it in place.
      if (absl::Status st = ReadShard(t, s, out.subspan(lo - start, s.count()));
          !st.ok()) {
        return st;
      }
      continue;
    }
    // Part of it: the whole shard is read, for its CRC-32.
    std::vector<float> values(s.count());
    if (absl::Status st = ReadShard(t, s, absl::MakeSpan(values)); !st.ok()) {
      return st;
    }
    std::copy(values.begin() + (lo - s.start()), values.begin() + (hi - s.start()),
              out.begin() + (lo - start));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::Verify() const {
  for (const v1::CheckpointTensor& t : metadata_.tensors()) {
    for (const v1::CheckpointShard& s : t.shards()) {
      std::vector<float> values(s.count());
      if (absl::Status st = ReadShard(t, s, absl::MakeSpan(values)); !st.ok()) {
        return st;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace cohort

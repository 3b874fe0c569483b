// Checkpoint write and read throughput of N forked ranks against the
// machine's own disk, in the same run: each round times
//   disk write  every rank writes its bytes to a file of its own, 1 MiB at
//               a time, then fsync (what a checkpoint cannot beat);
//   save        every rank saves the same bytes as one checkpoint shard
//               (CheckpointWriter::Save: copy, write, fsync, rename, folder
//               fsync, report, rank 0's metadata.json and commit);
//   disk read   every rank reads its file back;
//   load        every rank reads its shard back through CheckpointReader
//               (CRC-32 checked).
// Reads come from the page cache for both (the files were just written);
// the ratio of load to disk read is what the reader adds. Prints every
// round and the medians, per rank and in total.
//
//   bazel run //bench:checkpoint_bench -- --ranks=2 --mib_per_rank=256 --rounds=5 --dir=$PWD/ckpt-bench
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/file_store.h"
#include "worker/checkpoint/checkpoint.h"

ABSL_FLAG(int, ranks, 2, "Ranks (forked processes), each writing its part.");
ABSL_FLAG(int, mib_per_rank, 256, "MiB each rank writes per round.");
ABSL_FLAG(int, rounds, 5, "Rounds; medians are printed after them.");
ABSL_FLAG(std::string, dir, "checkpoint-bench",
          "Folder on the disk under test (created, emptied at the end).");

namespace {

using cohort::CheckpointCatalog;
using cohort::CheckpointReader;
using cohort::CheckpointWriter;

// Runs body(rank) in `ranks` forked processes; returns each one's seconds
// (what the body returns) and the wall time of all of them.
std::pair<std::vector<double>, double> RunRanks(
    int ranks, const std::function<double(int)>& body) {
  std::vector<int> pipes(ranks);
  std::vector<pid_t> pids(ranks);
  const absl::Time start = absl::Now();
  for (int r = 0; r < ranks; ++r) {
    int fds[2];
    if (pipe(fds) != 0) std::abort();
    pids[r] = fork();
    if (pids[r] == 0) {
      close(fds[0]);
      double seconds = body(r);
      if (write(fds[1], &seconds, sizeof(seconds)) != sizeof(seconds)) _exit(2);
      _exit(seconds < 0 ? 1 : 0);
    }
    close(fds[1]);
    pipes[r] = fds[0];
  }
  std::vector<double> seconds(ranks, -1);
  for (int r = 0; r < ranks; ++r) {
    if (read(pipes[r], &seconds[r], sizeof(double)) != sizeof(double)) {
      seconds[r] = -1;
    }
    close(pipes[r]);
    int status = 0;
    waitpid(pids[r], &status, 0);
  }
  return {seconds, absl::ToDoubleSeconds(absl::Now() - start)};
}

double DiskWrite(const std::string& path, const std::vector<char>& data) {
  const absl::Time start = absl::Now();
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return -1;
  const size_t chunk = 1 << 20;
  for (size_t done = 0; done < data.size(); done += chunk) {
    const size_t n = std::min(chunk, data.size() - done);
    if (write(fd, data.data() + done, n) != static_cast<ssize_t>(n)) return -1;
  }
  if (fsync(fd) != 0) return -1;
  close(fd);
  return absl::ToDoubleSeconds(absl::Now() - start);
}

double DiskRead(const std::string& path, size_t bytes) {
  std::vector<char> data(bytes);
  const absl::Time start = absl::Now();
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return -1;
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = read(fd, data.data() + done, bytes - done);
    if (n <= 0) return -1;
    done += n;
  }
  close(fd);
  return absl::ToDoubleSeconds(absl::Now() - start);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const size_t bytes = size_t{1} << 20;
  const size_t per_rank = bytes * absl::GetFlag(FLAGS_mib_per_rank);
  const size_t floats = per_rank / sizeof(float);
  const std::string dir = std::filesystem::absolute(absl::GetFlag(FLAGS_dir));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string store_path = dir + "/catalog.store";
  std::printf("checkpoint_bench: %d ranks x %zu MiB in %s\n", ranks,
              per_rank >> 20, dir.c_str());
  std::printf("%-6s %-10s %12s %12s\n", "round", "phase", "GB/s/rank",
              "GB/s total");
  const char* phases[] = {"disk write", "save", "disk read", "load"};
  std::vector<std::vector<double>> per(4), total(4);
  for (int round = 1; round <= absl::GetFlag(FLAGS_rounds); ++round) {
    auto record = [&](int phase,
                      const std::pair<std::vector<double>, double>& times) {
      if (*std::min_element(times.first.begin(), times.first.end()) < 0) {
        std::fprintf(stderr, "checkpoint_bench: %s failed\n", phases[phase]);
        std::exit(1);
      }
      const double rank_gbs = per_rank / Median(times.first) / 1e9;
      const double total_gbs = ranks * per_rank / times.second / 1e9;
      per[phase].push_back(rank_gbs);
      total[phase].push_back(total_gbs);
      std::printf("%-6d %-10s %12.3f %12.3f\n", round, phases[phase], rank_gbs,
                  total_gbs);
    };
    record(0, RunRanks(ranks, [&](int r) {
             std::vector<char> data(per_rank, static_cast<char>(r + round));
             return DiskWrite(absl::StrCat(dir, "/plain-", r), data);
           }));
    record(1, RunRanks(ranks, [&](int r) -> double {
             auto store = cohort::FileStore::Open(store_path);
             if (!store.ok()) return -1;
             CheckpointCatalog catalog(store->get(), cohort::CheckpointPrefix("bench"));
             auto writer = CheckpointWriter::Create(
                 {.dir = dir, .rank = r, .world_size = ranks, .catalog = &catalog});
             if (!writer.ok()) return -1;
             std::vector<float> shard(floats, static_cast<float>(r + round));
             const absl::Time start = absl::Now();
             absl::Status s = (*writer)->Save(
                 round, {{"w", {floats * ranks}, floats * r, shard}});
             if (!s.ok()) {
               std::fprintf(stderr, "rank %d: %s\n", r, s.ToString().c_str());
               return -1;
             }
             return absl::ToDoubleSeconds(absl::Now() - start);
           }));
    record(2, RunRanks(ranks, [&](int r) {
             return DiskRead(absl::StrCat(dir, "/plain-", r), per_rank);
           }));
    record(3, RunRanks(ranks, [&](int r) -> double {
             auto reader = CheckpointReader::Open(
                 absl::StrCat(dir, "/", cohort::CheckpointFolderName(round)));
             if (!reader.ok()) return -1;
             std::vector<float> shard(floats);
             const absl::Time start = absl::Now();
             if (!(*reader)->Read("w", floats * r, absl::MakeSpan(shard)).ok()) {
               return -1;
             }
             return absl::ToDoubleSeconds(absl::Now() - start);
           }));
    // Each round's checkpoint is deleted, so the disk does not fill.
    std::filesystem::remove_all(
        absl::StrCat(dir, "/", cohort::CheckpointFolderName(round)));
  }
  std::printf("medians over %d rounds:\n", absl::GetFlag(FLAGS_rounds));
  for (int phase = 0; phase < 4; ++phase) {
    std::printf("  %-10s %8.3f GB/s per rank %8.3f GB/s total\n", phases[phase],
                Median(per[phase]), Median(total[phase]));
  }
  std::printf("  save / disk write: %.2f per rank, %.2f total; load / disk read: %.2f, %.2f\n",
              Median(per[1]) / Median(per[0]), Median(total[1]) / Median(total[0]),
              Median(per[3]) / Median(per[2]), Median(total[3]) / Median(total[2]));
  std::filesystem::remove_all(dir);
  return 0;
}

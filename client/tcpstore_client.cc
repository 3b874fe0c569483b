#include "client/tcpstore_client.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/net.h"

namespace cohort {
namespace {

using tcpstore::Dialect;
using tcpstore::Op;
using tcpstore::Request;
using Call = TcpStoreCallOptions;

// At most this many keys are named in a timeout message, and checked one
// by one to tell which are missing.
constexpr size_t kKeysNamed = 16;
constexpr size_t kKeysChecked = 64;
// Fresh connections the server may close in reply to one request before
// the call concludes that the server refuses it.
constexpr int kMaxFreshDrops = 3;

uint32_t RandomU32() {
  thread_local std::mt19937 rng(std::random_device{}());
  return static_cast<uint32_t>(rng());
}

std::string KeyListText(absl::Span<const std::string> keys) {
  std::string out = "[";
  for (size_t i = 0; i < keys.size() && i < kKeysNamed; ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ", ", absl::CHexEscape(keys[i]));
  }
  if (keys.size() > kKeysNamed) {
    absl::StrAppend(&out, ", ... (", keys.size(), " keys)");
  }
  return out + "]";
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::Connect(
    const TcpStoreClientOptions& options) {
  for (absl::string_view one : absl::StrSplit(options.address, ',')) {
    if (!base::HostPortProblem(one).empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TCPStore address must be HOST:PORT (or several, comma-separated), "
          "got '",
          options.address, "'"));
    }
  }
  if (options.connect_timeout <= absl::ZeroDuration() ||
      options.reply_timeout <= absl::ZeroDuration() ||
      options.probe_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "connect_timeout, reply_timeout and probe_timeout must be > 0");
  }
  std::unique_ptr<TcpStoreClient> client(new TcpStoreClient(options));
  absl::MutexLock lock(&client->mu_);
  if (absl::Status s = client->Dial(absl::Now() + options.connect_timeout);
      !s.ok()) {
    return s;
  }
  return client;
}

TcpStoreClient::TcpStoreClient(const TcpStoreClientOptions& options)
    : options_(options) {
  if (options.dialect != TcpStoreDialect::kProbe) {
    resolved_ = true;
    dialect_ = options.dialect == TcpStoreDialect::kTorch113
                   ? Dialect::kTorch113
                   : Dialect::kTorch21;
  }
}

TcpStoreClient::~TcpStoreClient() = default;

tcpstore::Dialect TcpStoreClient::dialect() const {
  absl::MutexLock lock(&mu_);
  return dialect_;
}

absl::Status TcpStoreClient::Dial(absl::Time deadline) {
  conn_.reset();
  const absl::Time start = absl::Now();
  absl::Duration backoff = options_.initial_backoff;
  absl::Status last;
  int attempts = 0;
  // A 2.1 handshake: VALIDATE, then a PING whose nonce must come back.
  auto handshake = [&](Conn& c) {
    Request validate;
    validate.op = Op::kValidate;
    validate.word = tcpstore::kValidateMagic;
    c.Queue(validate);
    return c.Sync();
  };
  // The kProbe probe: true if the server answered a 1.13 GETNUMKEYS.
  auto probe = [&](Conn& c) {
    c.set_dialect(Dialect::kTorch113);
    c.Queue(Op::kNumKeys);
    if (!c.Flush().ok()) return false;
    return c.Word(8, std::min(deadline, absl::Now() + options_.probe_timeout))
        .ok();
  };
  for (;;) {
    ++attempts;
    absl::StatusOr<std::unique_ptr<TcpStoreConnection>> conn =
        TcpStoreConnection::Open(options_.address, deadline,
                                 options_.reply_timeout);
    if (conn.ok() && !resolved_ && probe(**conn)) {
      dialect_ = Dialect::kTorch113;
      resolved_ = true;
      conn_ = std::move(*conn);
      return absl::OkStatus();
    }
    if (conn.ok() && !resolved_) {
      // Not 1.13: a 2.1+ server closed or ignored the probe's connection.
      conn = TcpStoreConnection::Open(options_.address, deadline,
                                      options_.reply_timeout);
    }
    if (conn.ok()) {
      (*conn)->set_dialect(resolved_ ? dialect_ : Dialect::kTorch21);
      absl::Status s = (*conn)->dialect() == Dialect::kTorch21
                           ? handshake(**conn)
                           : absl::OkStatus();
      if (s.ok()) {
        dialect_ = (*conn)->dialect();
        resolved_ = true;
        conn_ = std::move(*conn);
        return absl::OkStatus();
      }
      if (absl::IsInternal(s)) return s;
      last = s;
      if (options_.dialect == TcpStoreDialect::kTorch21) {
        last = absl::Status(
            s.code(), absl::StrCat(s.message(),
                                   " (after VALIDATE + PING; a PyTorch "
                                   "1.13/2.0 server needs dialect 1.13)"));
      }
    } else {
      last = conn.status();
    }
    if (absl::Now() >= deadline) break;
    thread_local std::mt19937 rng(std::random_device{}());
    absl::SleepFor(std::min(
        backoff * std::uniform_real_distribution<double>(0.5, 1.0)(rng),
        deadline - absl::Now()));
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  return absl::UnavailableError(absl::StrCat(
      "cannot connect to the TCPStore server at ", options_.address, " within ",
      absl::FormatDuration(std::max(deadline - start, absl::ZeroDuration())),
      " (", attempts, attempts == 1 ? " attempt" : " attempts",
      "; last: ", last.message(), "): is it running there?"));
}

template <typename T>
absl::StatusOr<T> TcpStoreClient::Run(absl::string_view what,
                                      const TcpStoreCallOptions& call,
                                      Attempt<T> attempt) {
  absl::MutexLock lock(&mu_);
  auto explain = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  };
  absl::Time lost_at = absl::InfiniteFuture();
  absl::Duration backoff = options_.initial_backoff;
  int fresh_drops = 0;
  for (;;) {
    if (conn_ != nullptr && conn_->Stale()) conn_.reset();
    const bool fresh = conn_ == nullptr;
    if (fresh) {
      const absl::Time since = std::min(lost_at, absl::Now());
      if (absl::Status s = Dial(since + options_.connect_timeout); !s.ok()) {
        return explain(s);
      }
    }
    absl::StatusOr<T> result = attempt(*conn_);
    if (!conn_->broken()) {
      if (result.ok() || absl::IsDeadlineExceeded(result.status())) {
        return result;
      }
      return explain(result.status());
    }
    conn_.reset();
    const absl::Status& s = result.status();
    if (result.ok() || absl::IsDeadlineExceeded(s)) return result;
    if (!absl::IsUnavailable(s)) return explain(s);
    if (!call.retry_lost_connection) {
      return explain(absl::UnavailableError(
          absl::StrCat(s.message(),
                       "; the change may or may not have been applied "
                       "(not retried: repeating it is not safe)")));
    }
    if (fresh && ++fresh_drops >= kMaxFreshDrops) {
      return explain(absl::FailedPreconditionError(absl::StrCat(
          "the TCPStore server at ", options_.address, " closed ",
          kMaxFreshDrops,
          " fresh connections in reply to this request, so it refuses it "
          "(torch servers close the connection on a request they cannot "
          "serve: a key over their limits, an unknown query for their "
          "release); last: ",
          s.message())));
    }
    if (lost_at == absl::InfiniteFuture()) lost_at = absl::Now();
    if (fresh) {
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
  }
}

absl::Status TcpStoreClient::WaitOn(Conn& c,
                                    const std::vector<std::string>& keys,
                                    absl::Span<const std::string> user_keys,
                                    absl::Duration timeout, absl::Time deadline,
                                    absl::string_view what) const {
  if (keys.empty()) return absl::OkStatus();
  c.QueueKeys(Op::kWait, keys);
  if (absl::Status s = c.Flush(); !s.ok()) return s;
  absl::StatusOr<uint64_t> reply = c.Word(1, deadline);
  if (reply.ok()) {
    if (*reply == static_cast<uint8_t>(tcpstore::WaitReply::kStopWaiting)) {
      return absl::OkStatus();
    }
    return c.Violation(absl::StrCat("WAIT answered ", *reply));
  }
  if (!absl::IsDeadlineExceeded(reply.status())) return reply.status();
  const std::string head =
      absl::StrCat(what, " for keys ", KeyListText(user_keys),
                   " timed out after ", absl::FormatDuration(timeout));
  if (c.dialect() == Dialect::kTorch113) {
    c.Drop();
    return absl::DeadlineExceededError(absl::StrCat(
        head,
        " (the PyTorch 1.13 protocol cannot cancel a wait: the connection "
        "was closed and the next call reconnects)"));
  }
  c.Queue(Op::kCancelWait);
  if (absl::Status s = c.Flush(); !s.ok()) return s;
  absl::StatusOr<uint64_t> cancel = c.Word(1);
  if (!cancel.ok()) return cancel.status();
  if (*cancel == static_cast<uint8_t>(tcpstore::WaitReply::kStopWaiting)) {
    // The keys arrived while the cancel was on its way: the wait is met.
    cancel = c.Word(1);
    if (!cancel.ok()) return cancel.status();
    if (*cancel == static_cast<uint8_t>(tcpstore::WaitReply::kWaitCanceled)) {
      return absl::OkStatus();
    }
  }
  if (*cancel != static_cast<uint8_t>(tcpstore::WaitReply::kWaitCanceled)) {
    return c.Violation(absl::StrCat("CANCEL_WAIT answered ", *cancel));
  }
  if (keys.size() > kKeysChecked) return absl::DeadlineExceededError(head);
  for (const std::string& k : keys) c.QueueKeys(Op::kCheck, {k});
  if (absl::Status s = c.Flush(); !s.ok()) return s;
  std::vector<std::string> missing;
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<uint64_t> ready = c.Word(1);
    if (!ready.ok()) return ready.status();
    if (*ready == static_cast<uint8_t>(tcpstore::CheckReply::kNotReady)) {
      missing.push_back(user_keys[i]);
    } else if (*ready != static_cast<uint8_t>(tcpstore::CheckReply::kReady)) {
      return c.Violation(absl::StrCat("CHECK answered ", *ready));
    }
  }
  std::string list = KeyListText(missing);
  return absl::DeadlineExceededError(
      absl::StrCat(head, "; missing: ", list.substr(1, list.size() - 2)));
}

std::vector<std::string> TcpStoreClient::Keys(
    absl::Span<const std::string> keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const std::string& k : keys) out.push_back(Key(k));
  return out;
}

absl::Status TcpStoreClient::RunStatus(
    absl::string_view what, const TcpStoreCallOptions& call,
    absl::FunctionRef<absl::Status(Conn&)> attempt) {
  return Run<bool>(what, call,
                   [&](Conn& c) -> absl::StatusOr<bool> {
                     absl::Status s = attempt(c);
                     if (!s.ok()) return s;
                     return true;
                   })
      .status();
}

absl::Status TcpStoreClient::Set(absl::string_view key,
                                 absl::string_view value) {
  const std::string k = Key(key);
  return RunStatus("set", Call::Retryable(), [&](Conn& c) {
    Request r;
    r.op = Op::kSet;
    r.key = k;
    r.value = value;
    c.Queue(r);
    return c.Sync();
  });
}

absl::StatusOr<std::string> TcpStoreClient::Get(absl::string_view key,
                                                absl::Duration timeout) {
  const std::vector<std::string> user_keys = {std::string(key)};
  const std::vector<std::string> keys = Keys(user_keys);
  const absl::Time deadline = absl::Now() + timeout;
  return Run<std::string>(
      "get", Call::Retryable(), [&](Conn& c) -> absl::StatusOr<std::string> {
        if (absl::Status s =
                WaitOn(c, keys, user_keys, timeout, deadline, "get: wait");
            !s.ok()) {
          return s;
        }
        c.Queue(Op::kGet, keys[0]);
        if (absl::Status s = c.Flush(); !s.ok()) return s;
        return c.Bytes();
      });
}

absl::StatusOr<int64_t> TcpStoreClient::Add(absl::string_view key,
                                            int64_t delta) {
  const std::string k = Key(key);
  return Run<int64_t>("add", Call::Once(),
                      [&](Conn& c) -> absl::StatusOr<int64_t> {
                        Request r;
                        r.op = Op::kAdd;
                        r.key = k;
                        r.number = delta;
                        c.Queue(r);
                        if (absl::Status s = c.Flush(); !s.ok()) return s;
                        return c.I64();
                      });
}

absl::StatusOr<std::string> TcpStoreClient::CompareSet(
    absl::string_view key, absl::string_view expected,
    absl::string_view desired) {
  const std::string k = Key(key);
  return Run<std::string>("compare_set", Call::Once(),
                          [&](Conn& c) -> absl::StatusOr<std::string> {
                            Request r;
                            r.op = Op::kCompareSet;
                            r.key = k;
                            r.expected = expected;
                            r.value = desired;
                            c.Queue(r);
                            if (absl::Status s = c.Flush(); !s.ok()) return s;
                            return c.Bytes();
                          });
}

absl::Status TcpStoreClient::Wait(absl::Span<const std::string> keys,
                                  absl::Duration timeout) {
  const std::vector<std::string> wire_keys = Keys(keys);
  const absl::Time deadline = absl::Now() + timeout;
  return RunStatus("wait", Call::Retryable(), [&](Conn& c) {
    return WaitOn(c, wire_keys, keys, timeout, deadline, "wait");
  });
}

absl::StatusOr<bool> TcpStoreClient::Check(absl::Span<const std::string> keys) {
  const std::vector<std::string> wire_keys = Keys(keys);
  return Run<bool>(
      "check", Call::Retryable(), [&](Conn& c) -> absl::StatusOr<bool> {
        c.QueueKeys(Op::kCheck, wire_keys);
        if (absl::Status s = c.Flush(); !s.ok()) return s;
        absl::StatusOr<uint64_t> reply = c.Word(1);
        if (!reply.ok()) return reply.status();
        if (*reply > 1)
          return c.Violation(absl::StrCat("CHECK answered ", *reply));
        return *reply == static_cast<uint8_t>(tcpstore::CheckReply::kReady);
      });
}

absl::StatusOr<bool> TcpStoreClient::DeleteKey(absl::string_view key) {
  const std::string k = Key(key);
  return Run<bool>("delete", Call::Retryable(),
                   [&](Conn& c) -> absl::StatusOr<bool> {
                     c.Queue(Op::kDeleteKey, k);
                     if (absl::Status s = c.Flush(); !s.ok()) return s;
                     absl::StatusOr<int64_t> deleted = c.I64();
                     if (!deleted.ok()) return deleted.status();
                     return *deleted > 0;
                   });
}

absl::StatusOr<int64_t> TcpStoreClient::NumKeys() {
  return Run<int64_t>("num_keys", Call::Retryable(), [&](Conn& c) {
    c.Queue(Op::kNumKeys);
    if (absl::Status s = c.Flush(); !s.ok()) return absl::StatusOr<int64_t>(s);
    return c.I64();
  });
}

absl::StatusOr<std::vector<std::string>> TcpStoreClient::MultiGet(
    absl::Span<const std::string> keys, absl::Duration timeout) {
  const std::vector<std::string> wire_keys = Keys(keys);
  const absl::Time deadline = absl::Now() + timeout;
  using Values = std::vector<std::string>;
  return Run<Values>("multi_get", Call::Retryable(),
                     [&](Conn& c) -> absl::StatusOr<Values> {
                       if (absl::Status s = WaitOn(c, wire_keys, keys, timeout,
                                                   deadline, "multi_get: wait");
                           !s.ok()) {
                         return s;
                       }
                       Values values;
                       if (keys.empty()) return values;
                       if (c.dialect() == Dialect::kTorch113) {
                         for (const std::string& k : wire_keys)
                           c.Queue(Op::kGet, k);
                       } else {
                         c.QueueKeys(Op::kMultiGet, wire_keys);
                       }
                       if (absl::Status s = c.Flush(); !s.ok()) return s;
                       values.reserve(keys.size());
                       for (size_t i = 0; i < keys.size(); ++i) {
                         absl::StatusOr<std::string> v = c.Bytes();
                         if (!v.ok()) return v.status();
                         values.push_back(std::move(*v));
                       }
                       return values;
                     });
}

absl::Status TcpStoreClient::MultiSet(absl::Span<const std::string> keys,
                                      absl::Span<const std::string> values) {
  if (keys.size() != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "multi_set: ", keys.size(), " keys but ", values.size(), " values"));
  }
  const std::vector<std::string> wire_keys = Keys(keys);
  return RunStatus("multi_set", Call::Retryable(), [&](Conn& c) {
    Request r;
    if (c.dialect() == Dialect::kTorch113) {
      r.op = Op::kSet;
      for (size_t i = 0; i < keys.size(); ++i) {
        r.key = wire_keys[i];
        r.value = values[i];
        c.Queue(r);
      }
    } else if (!keys.empty()) {
      r.op = Op::kMultiSet;
      r.keys.assign(wire_keys.begin(), wire_keys.end());
      r.values.assign(values.begin(), values.end());
      c.Queue(r);
    }
    return c.Sync();
  });
}

absl::Status TcpStoreClient::Append(absl::string_view key,
                                    absl::string_view value) {
  const std::string k = Key(key);
  auto compare_set = [&](Conn& c, absl::string_view expected,
                         absl::string_view desired) {
    Request r;
    r.op = Op::kCompareSet;
    r.key = k;
    r.expected = expected;
    r.value = desired;
    c.Queue(r);
    absl::Status s = c.Flush();
    return s.ok() ? c.Bytes() : absl::StatusOr<std::string>(s);
  };
  return RunStatus("append", Call::Once(), [&](Conn& c) {
    if (c.dialect() == Dialect::kTorch21) {
      Request r;
      r.op = Op::kAppend;
      r.key = k;
      r.value = value;
      c.Queue(r);
      return c.Sync();
    }
    // Read without writing: a random token as both expected and desired
    // comes back as it is if the key is missing, else the current value.
    const std::string token = absl::StrCat(
        "\x01"
        "cohort-append/",
        RandomU32(), "/", RandomU32());
    absl::StatusOr<std::string> current = compare_set(c, token, token);
    if (!current.ok()) return current.status();
    std::string expected = *current == token ? "" : *current;
    for (int i = 0; i < 10000; ++i) {
      const std::string desired = absl::StrCat(expected, value);
      current = compare_set(c, expected, desired);
      if (!current.ok()) return current.status();
      if (*current == desired) return absl::OkStatus();
      // Equal to `expected` only when the key was deleted.
      expected = *current == expected ? "" : *current;
    }
    return absl::AbortedError(
        "gave up after 10000 compare_set rounds lost to other writers");
  });
}

absl::StatusOr<KeyList> TcpStoreClient::ListKeys(absl::string_view prefix) {
  if (dialect() == Dialect::kTorch113) {
    return absl::UnimplementedError(
        "list_keys: the PyTorch 1.13 TCPStore protocol has no LIST_KEYS "
        "(connect with the 2.1 dialect to a server that has it: cohortd)");
  }
  const std::string want = Key(prefix);
  return Run<KeyList>(
      "list_keys", Call::Retryable(), [&](Conn& c) -> absl::StatusOr<KeyList> {
        c.Queue(Op::kListKeys);
        if (absl::Status s = c.Flush(); !s.ok()) return s;
        absl::StatusOr<int64_t> count = c.I64();
        if (!count.ok()) return count.status();
        if (*count < 0 || *count > (int64_t{1} << 32)) {
          return c.Violation(absl::StrCat("LIST_KEYS count ", *count));
        }
        KeyList list;
        for (int64_t i = 0; i < *count; ++i) {
          absl::StatusOr<std::string> key = c.Bytes();
          if (!key.ok()) return key.status();
          if (absl::StartsWith(*key, want)) {
            list.keys.push_back(key->substr(options_.key_prefix.size()));
          }
        }
        std::sort(list.keys.begin(), list.keys.end());
        return list;
      });
}

absl::StatusOr<std::unique_ptr<WatchHandle>> TcpStoreClient::Watch(
    absl::string_view, int64_t, WatchCallback) {
  return absl::UnimplementedError(
      "watch: the TCPStore protocol has no watch; use RemoteStore "
      "(cohort://)");
}

}  // namespace cohort

// The session and its channel: the end of a session, the drop when its daemon went away,
// and the registration made again on a fresh channel, with bounded backoff, after a daemon
// restart (client/session.h says when a call counts the daemon as gone).
#include "client/session.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <utility>

#include "client/errors.h"
#include "proto/level_codec.h"

namespace ckpt {
namespace {

constexpr std::chrono::seconds kDefaultReconnectBudget{120};
constexpr const char* kReconnectBudgetEnv = "CKPT_RECONNECT_BUDGET_S";

std::string Seconds(std::chrono::milliseconds ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

}  // namespace

std::chrono::milliseconds ReconnectBudget(const ClientOptions& options) {
  // Clamped to 1e9 s (the environment's limit too), so that start + budget cannot overflow.
  constexpr std::chrono::milliseconds kMaxBudget{std::int64_t{1'000'000'000} * 1000};
  if (options.reconnect_budget) {
    return std::clamp(*options.reconnect_budget, std::chrono::milliseconds(0), kMaxBudget);
  }
  const char* env = std::getenv(kReconnectBudgetEnv);
  if (env == nullptr || *env == '\0') return kDefaultReconnectBudget;
  char* end = nullptr;
  errno = 0;
  const double seconds = std::strtod(env, &end);
  if (errno != 0 || end == env || *end != '\0' || !std::isfinite(seconds) || seconds < 0 || seconds > 1e9) {
    throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT),
                std::string("$") + kReconnectBudgetEnv + "='" + env +
                    "' is not a number of seconds (>= 0; 0 turns reconnection off)");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000.0)));
}

std::shared_ptr<v1::Checkpoint::Stub> NewStub(const std::string& socket_path) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  return v1::Checkpoint::NewStub(
      grpc::CreateCustomChannel("unix:" + socket_path, grpc::InsecureChannelCredentials(), args));
}

grpc::Status CallWait(v1::Checkpoint::Stub& stub, const std::string& session, std::uint64_t version,
                      v1::Level level, std::chrono::milliseconds timeout, bool stream_ordered,
                      v1::WaitReply* rep, bool seal) {
  grpc::ClientContext ctx;
  v1::WaitRequest req;
  req.set_session(session);
  req.set_version(version);
  req.set_level(level);
  req.set_timeout_ms(static_cast<std::uint64_t>(timeout.count()));
  req.set_stream_ordered(stream_ordered);
  req.set_seal(seal);
  return stub.Wait(&ctx, req, rep);
}

void UnregisterQuietly(v1::Checkpoint::Stub& stub, const std::string& session) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::UnregisterRequest req;
  v1::UnregisterReply rep;
  req.set_session(session);
  (void)stub.Unregister(&ctx, req, &rep);
}

void Client::Impl::EndSessionLocked() {
  session.clear();
  instance.clear();
  cuda.reset();
  trainer_slots = TrainerSlotBook();
  last_snapshot = 0;
  versions.clear();
  daemon_lost = false;
  words_in_use = false;
}

bool Client::Impl::DaemonGone(const grpc::Status& s, const Call& c) {
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) return true;
  if (s.error_code() != grpc::StatusCode::NOT_FOUND || c.instance.empty() || !c.stub) return false;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::StatusReply rep;
  grpc::Status st = c.stub->Status(&ctx, v1::StatusRequest(), &rep);
  if (!st.ok()) return st.error_code() == grpc::StatusCode::UNAVAILABLE;
  return rep.daemon_instance() != c.instance;
}

void Client::Impl::DropSessionLocked() {
  lost.AddSession(versions);
  versions.clear();
  session.clear();
  instance.clear();
  trainer_slots = cuda ? TrainerSlotBook(kTrainerEventSlots) : TrainerSlotBook();
  last_snapshot = 0;
  daemon_lost = true;
  words_in_use = false;  // the watch stays: the daemon's exit still releases its waits
}

v1::RegisterReply Client::Impl::RecoverLocked(const std::string& cause) {
  if (!daemon_lost) DropSessionLocked();
  const std::string in_flight = lost.UnreportedList();
  const std::string lost_note = in_flight.empty() ? "" : "; versions not known committed then: " + in_flight;
  std::fprintf(stderr, "ckpt: %s: ckptd at %s went away; registering again (reconnect budget %s s)\n",
               cause.c_str(), socket_path.c_str(), Seconds(reconnect_budget).c_str());
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + reconnect_budget;
  std::chrono::milliseconds backoff = std::max(std::chrono::milliseconds(1), initial_backoff);
  for (int attempts = 1;; ++attempts) {
    std::shared_ptr<v1::Checkpoint::Stub> fresh = NewStub(socket_path);
    grpc::ClientContext ctx;
    // A daemon that is up answers at once; one still starting (or reaping) gets a little
    // more than the budget's rest, so that a small budget still lets it answer.
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::max<std::chrono::steady_clock::duration>(
                         std::chrono::seconds(5), deadline - std::chrono::steady_clock::now()));
    v1::RegisterRequest req = RequestLocked(job, rank, world_size);
    v1::RegisterReply rep;
    grpc::Status s = fresh->Register(&ctx, req, &rep);
    if (s.ok()) {
      InstallSessionLocked(fresh, rep);
      std::fprintf(stderr, "ckpt: re-registered job %s rank %u/%u with ckptd at %s after %.1f s%s\n",
                   job.c_str(), rank, world_size, socket_path.c_str(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                   lost_note.c_str());
      return rep;
    }
    // CANCELLED: the daemon reached was shutting down (a restart's first half), which
    // cancels the calls it still has; the restarted one is what the budget waits for.
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE &&
        s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
        s.error_code() != grpc::StatusCode::CANCELLED) {
      Throw(s, cause + ": registering again with the restarted ckptd at " + socket_path);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      const std::string within = reconnect_budget.count() == 0
                                     ? " is not back, and the reconnect budget is 0 (no waiting)"
                                     : " did not come back within " + Seconds(reconnect_budget) + " s";
      throw Error(static_cast<int>(grpc::StatusCode::UNAVAILABLE),
                  cause + ": ckptd at " + socket_path + within + " (" + std::to_string(attempts) +
                      (attempts == 1 ? " attempt" : " attempts") + "; last: " + s.error_message() + ")" +
                      lost_note + "; the next call tries again");
    }
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::max(backoff, max_backoff));
  }
}

void Client::Impl::InstallSessionLocked(const std::shared_ptr<v1::Checkpoint::Stub>& fresh,
                                        const v1::RegisterReply& rep) {
  if (cuda) {
    std::vector<std::string> handles(rep.daemon_events().begin(), rep.daemon_events().end());
    if (Status st = cuda->OpenDaemonEvents(handles); !st.ok()) {
      UnregisterQuietly(*fresh, rep.session());
      ThrowWithCode(st.With("register again after a daemon restart"));
    }
    UseReleaseWordsLocked(rep);
  }
  stub = fresh;
  session = rep.session();
  instance = rep.daemon_instance();
  ++epoch;
  daemon_lost = false;
  served = true;
}

Client::Impl::Call Client::Impl::Current(const std::string& what) {
  MutexLock lock(mu);
  EnsureSessionLocked(what);
  return CallLocked();
}

void Client::Impl::EnsureSessionLocked(const std::string& what) {
  if (!session.empty()) return;
  if (daemon_lost) {
    RecoverLocked(what + " (the daemon was gone at an earlier call)");
    return;
  }
  throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION),
              "not registered: call register_items first");
}

void Client::Impl::Recover(const Call& c, const std::string& cause) {
  MutexLock lock(mu);
  if (epoch != c.epoch && !session.empty()) return;
  RecoverLocked(cause);
}

void Client::Impl::WaitReturned(const Call& c, std::uint64_t version, const grpc::Status& s,
                                const v1::WaitReply& rep) {
  MutexLock lock(mu);
  if (c.epoch != epoch || c.session != session) return;
  if (WaitReleasesSlot(s.error_code())) trainer_slots.Release(version);
  if (!s.ok()) return;
  auto it = versions.find(version);
  if (it != versions.end()) it->second = std::max(it->second, LevelFromProto(rep.reached()));
}

void Client::Impl::SnapshotTaken(const Call& c, std::uint64_t version) {
  MutexLock lock(mu);
  if (c.epoch != epoch) return;
  versions[version] = Level::kNone;
  while (versions.size() > kVersionsTracked) versions.erase(versions.begin());
  lost.Forget(version);
}

std::string Client::Impl::RefreshLostLocked() {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::ListRequest req;
  req.set_job(job);
  v1::ListReply rep;
  grpc::Status s = stub->List(&ctx, req, &rep);
  if (!s.ok()) return "the restarted daemon could not list job '" + job + "': " + s.error_message();
  lost.NoteListing(rep.versions(), rank);
  return "newest committed version: " + std::to_string(rep.latest());
}

bool Client::Impl::CommittedAfterRestart(std::uint64_t version) {
  MutexLock lock(mu);
  if (lost.Contains(version)) return false;
  lost.AddReported(version);
  (void)RefreshLostLocked();
  if (lost.Reached(version) >= Level::kCommitted) return true;
  lost.Forget(version);
  return false;
}

bool Client::Impl::AnswerLost(std::uint64_t version, Level level) {
  MutexLock lock(mu);
  if (versions.count(version) != 0) return false;
  if (!lost.Contains(version)) return false;
  if (lost.Reached(version) >= level) return true;
  const std::string note = RefreshLostLocked();
  if (lost.Reached(version) >= level) return true;
  throw *lost.Report(version, note);
}

bool Client::Impl::Wait(std::uint64_t version, Level level, std::chrono::milliseconds timeout,
                        bool stream_ordered, const std::string& what, Call* used, bool* ordered,
                        v1::WaitReply* rep, bool seal) {
  for (;;) {
    Call c = Current(what);
    if (AnswerLost(version, level)) return false;
    *ordered = stream_ordered && UseStreamOrderedWait(c.cuda != nullptr, c.last_snapshot, version);
    grpc::Status s = CallWait(*c.stub, c.session, version, LevelToProto(level), timeout, *ordered, rep, seal);
    WaitReturned(c, version, s, *rep);
    if (s.ok()) {
      *used = std::move(c);
      return true;
    }
    if (s.error_code() == grpc::StatusCode::ABORTED) {
      throw TornSnapshotError(what + ": " + s.error_message(), version);
    }
    if (!DaemonGone(s, c)) Throw(s, what);
    Recover(c, what + ": " + s.error_message());
  }
}

}  // namespace ckpt

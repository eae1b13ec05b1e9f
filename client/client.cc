// libckpt: the client side of the ckpt.v1 API (see ckpt/client.h for the contract).
//
// In: the trainer's calls. Out: gRPC calls to ckptd over its Unix socket, the descriptor
// table in shared memory, and, for GPU tensors, CUDA IPC exports and interprocess events
// (client/cuda_tensors.h). Errors are thrown as ckpt::Error, as the public API promises.
// Thread-safety: a mutex guards the registration and the connection. Register (and the
// reconnection after a daemon restart, which may take the whole reconnect budget) runs
// under it; the RPCs that may block for long (Wait, Snapshot, Restore) run outside it, on
// the stub and session they read under it, and compare the session epoch afterwards.
//
// Daemon restarts (see ckpt/client.h): a call that fails with UNAVAILABLE, or with
// NOT_FOUND from a daemon whose daemon_instance is not the session's, drops the session
// (its versions become "lost" versions, with the level each was known to have reached)
// and registers again on a fresh channel: a channel that saw its daemon die backs off its
// own reconnections for up to minutes, which the client's bounded backoff replaces.
#include "ckpt/client.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <thread>
#include <tuple>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "client/cuda_tensors.h"
#include "client/release_words.h"
#include "common/mutex.h"
#include "common/socket_path.h"
#include "format/dtype.h"
#include "proto/level_codec.h"
#include "shm/descriptor_table.h"
#include "shm/shm_region.h"

namespace ckpt {

namespace {

[[noreturn]] void Throw(const grpc::Status& s, const std::string& what) {
  std::string msg = what + ": " + s.error_message();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) msg += " (is ckptd running?)";
  throw Error(static_cast<int>(s.error_code()), msg);
}

[[noreturn]] void Throw(const Status& s) {
  throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION), s.message());
}

[[noreturn]] void ThrowWithCode(const Status& s) { throw Error(GrpcCodeNumber(s.code()), s.message()); }

class PosixSharedRegion : public SharedRegion {
 public:
  explicit PosixSharedRegion(ShmRegion r) : region_(std::move(r)) {}
  void* data() const override { return region_.data(); }
  std::size_t size() const override { return region_.size(); }
  const std::string& name() const override { return region_.name(); }
  std::uint64_t generation() const override { return region_.generation(); }
  void resize(std::size_t bytes) override {
    if (Status s = region_.Resize(bytes); !s.ok()) Throw(s);
  }
  std::optional<std::uint64_t> object_size() const { return region_.ObjectSize(); }

 private:
  ShmRegion region_;
};

std::uint64_t ElementSize(DType t) { return DTypeSize(t); }

constexpr std::chrono::seconds kDefaultReconnectBudget{120};
constexpr const char* kReconnectBudgetEnv = "CKPT_RECONNECT_BUDGET_S";
// Versions per session (and lost ones) whose reached level the client remembers; the daemon
// answers Wait for its newest 16 only, and admits at most 32 in flight.
constexpr std::size_t kVersionsTracked = 64;

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

std::string Seconds(std::chrono::milliseconds ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

// A stub on a channel of its own (see the top of this file).
std::shared_ptr<v1::Checkpoint::Stub> NewStub(const std::string& socket_path) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  return v1::Checkpoint::NewStub(
      grpc::CreateCustomChannel("unix:" + socket_path, grpc::InsecureChannelCredentials(), args));
}

// The level `rank` has reached in `version` by what the daemon finds on storage.
Level LevelOnStorage(const v1::VersionInfo& v, std::uint32_t rank) {
  auto has = [rank](const auto& ranks) { return std::find(ranks.begin(), ranks.end(), rank) != ranks.end(); };
  if (v.committed()) return Level::kCommitted;
  if (has(v.durable_ranks())) return Level::kPersisted;
  if (has(v.local_ranks())) return Level::kLocal;
  if (has(v.memory_ranks())) return Level::kCaptured;
  return Level::kNone;
}

// What a version lost to a restart did not become, by the level it had reached.
std::string LostPhrase(std::uint64_t version, Level reached) {
  const std::string v = "version " + std::to_string(version);
  if (reached < Level::kCaptured) return v + " was not captured";
  if (reached < Level::kPersisted) return v + " was not made durable";
  return v + " was not committed";
}

// One Wait RPC. The caller notes its return (Impl::WaitReturned) before throwing.
grpc::Status CallWait(v1::Checkpoint::Stub& stub, const std::string& session, std::uint64_t version,
                      v1::Level level, std::chrono::milliseconds timeout, bool stream_ordered,
                      v1::WaitReply* rep, bool seal = false) {
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

// Unregisters `session`, best effort: used where the client drops a session on its own.
void UnregisterQuietly(v1::Checkpoint::Stub& stub, const std::string& session) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::UnregisterRequest req;
  v1::UnregisterReply rep;
  req.set_session(session);
  (void)stub.Unregister(&ctx, req, &rep);
}

}  // namespace

#if !defined(CKPT_HAVE_CUDA)
Result<std::shared_ptr<CudaTensors>> ResolveCudaTensors(const std::vector<CudaTensorSpec>& tensors) {
  return FailedPrecondition("GPU tensor '" + (tensors.empty() ? std::string() : tensors.front().name) +
                            "': this libckpt was built without CUDA; rebuild it where the CUDA toolkit is "
                            "installed, or keep the tensor in a ckpt::SharedRegion");
}
#endif

namespace {

Mutex resolver_mu;
CudaTensorsResolver test_resolver GUARDED_BY(resolver_mu);

Result<std::shared_ptr<CudaTensors>> ResolveGpuTensors(const std::vector<CudaTensorSpec>& tensors) {
  CudaTensorsResolver resolver;
  {
    MutexLock lock(resolver_mu);
    resolver = test_resolver;
  }
  return resolver ? resolver(tensors) : ResolveCudaTensors(tensors);
}

}  // namespace

void SetCudaTensorsResolverForTesting(CudaTensorsResolver resolver) {
  MutexLock lock(resolver_mu);
  test_resolver = std::move(resolver);
}

std::shared_ptr<SharedRegion> SharedRegion::create(std::size_t bytes, const std::string& name) {
  auto r = ShmRegion::Create(name, bytes);
  if (!r.ok()) Throw(r.status());
  return std::make_shared<PosixSharedRegion>(std::move(r).value());
}

struct Client::Impl {
  std::string socket_path;
  std::chrono::milliseconds reconnect_budget{0};
  std::chrono::milliseconds initial_backoff{0};
  std::chrono::milliseconds max_backoff{0};

  Mutex mu;  // guards the registration and the connection
  std::shared_ptr<v1::Checkpoint::Stub> stub GUARDED_BY(mu);
  std::string session GUARDED_BY(mu);
  std::string instance GUARDED_BY(mu);  // daemon_instance of the session's daemon ("" if it has none)
  // Sessions made so far: a call made on a session compares it afterwards, to tell whether
  // what it learnt still applies.
  std::uint64_t epoch GUARDED_BY(mu) = 0;
  // The registration a restart makes again.
  std::string job GUARDED_BY(mu);
  std::uint32_t rank GUARDED_BY(mu) = 0;
  std::uint32_t world_size GUARDED_BY(mu) = 0;
  RegisterOptions options GUARDED_BY(mu);
  // The daemon went away and no session has been made since: the next call reconnects.
  bool daemon_lost GUARDED_BY(mu) = false;
  // A daemon accepted a registration of this client once: only then is a daemon waited for.
  bool served GUARDED_BY(mu) = false;
  // Versions snapshotted in this session: the level each is known to have reached (kNone:
  // not yet known to be captured).
  std::map<std::uint64_t, Level> versions GUARDED_BY(mu);
  // Versions of sessions a daemon restart ended.
  struct LostVersion {
    Level reached = Level::kNone;  // known before the restart, or found on storage since
    bool reported = false;         // named in an error already (or committed: nothing to report)
  };
  std::map<std::uint64_t, LostVersion> lost GUARDED_BY(mu);

  std::optional<DescriptorTable> table GUARDED_BY(mu);
  struct Registered {
    std::shared_ptr<SharedRegion> region;
    std::uint64_t generation;
    std::size_t size;
    std::string item;
  };
  std::vector<Registered> registered GUARDED_BY(mu);
  // The items' global layouts, sent with every registration (a reconnection's too).
  google::protobuf::RepeatedPtrField<v1::ItemLayout> layouts GUARDED_BY(mu);
  // The GPU side of the registration; null when it has no GPU tensors. Shared so that a
  // call in flight keeps it alive across a concurrent re-registration.
  std::shared_ptr<CudaTensors> cuda GUARDED_BY(mu);
  TrainerSlotBook trainer_slots GUARDED_BY(mu);
  std::uint64_t last_snapshot GUARDED_BY(mu) = 0;  // newest version passed to snapshot() in this session
  // The stall of the last wait_snapshot, in ns, not yet sent to the daemon (-1: none); the
  // next snapshot reports it (ckptd_snapshot_stall_seconds). An atomic, so the wait that
  // measured it takes no lock after its clock stopped.
  std::atomic<std::int64_t> unreported_stall_ns{-1};

  // The release words (client/release_words.h), made at the first GPU registration and kept
  // for the client's life: their floor must only grow across sessions and daemons.
  std::shared_ptr<ReleaseWords> words GUARDED_BY(mu);
  std::shared_ptr<const void> words_mapping GUARDED_BY(mu);  // their CUDA registration; null: not made
  std::string words_unused GUARDED_BY(mu);                   // why the session waits on events instead
  bool words_in_use GUARDED_BY(mu) = false;                  // this session's stream waits use them
  // Releases the words when the daemon process of the session exits.
  std::unique_ptr<DaemonWatch> watch GUARDED_BY(mu);

  ~Impl() {
    MutexLock lock(mu);
    watch.reset();
    if (!words) return;
    // A stream may still have a wait on a word queued: end it, and keep the page mapped and
    // registered until the process exits (4 KiB per client), never unmapped under a wait;
    // its name goes now.
    words->ReleaseAll();
    words->Unlink();
    static Mutex retired_mu;
    static auto* retired = new std::vector<std::shared_ptr<const void>>();
    MutexLock hold(retired_mu);
    retired->push_back(words);
    if (words_mapping) retired->push_back(words_mapping);
  }

  // Before a GPU registration: makes the release words and maps them for the device once;
  // on failure the registration goes on with events only (words_unused says why).
  void PrepareReleaseWordsLocked(CudaTensors& gpu) REQUIRES(mu) {
    if (words_mapping) return;
    if (!words) {
      auto made = ReleaseWords::Create();
      if (!made.ok()) {
        words_unused = made.status().message();
        return;
      }
      words = std::move(made).value();
    }
    auto mapped = gpu.MapReleaseWords(words->data(), kReleaseWordsBytes);
    if (!mapped.ok()) {
      words_unused = mapped.status().message();
      return;
    }
    words_mapping = std::move(mapped).value();
    if (!watch) watch = std::make_unique<DaemonWatch>([w = words] { w->ReleaseAll(); });
  }

  // The release words of a new or renewed registration.
  void AddReleaseWordsLocked(v1::CudaSession* c) REQUIRES(mu) {
    if (!words_mapping) return;
    c->set_release_words(words->name());
    c->set_release_base(words->SessionBase());
  }

  // A daemon accepted a GPU registration: its stream-ordered waits use the release words
  // only if it writes them and its process can be watched from here.
  void UseReleaseWordsLocked(const v1::RegisterReply& rep) REQUIRES(mu) {
    words_in_use = false;
    if (!words_mapping) return;
    if (!rep.release_words()) {
      words_unused = "ckptd does not write them (see its log)";
      return;
    }
    if (Status st = watch->Watch(static_cast<pid_t>(rep.daemon_pid()), rep.daemon_pid_namespace());
        !st.ok()) {
      words_unused = "ckptd's process cannot be watched: " + st.message();
      return;
    }
    words_in_use = true;
  }

  // What a call outside the lock uses: read together under it.
  struct Call {
    std::shared_ptr<v1::Checkpoint::Stub> stub;
    std::string session;
    std::string instance;
    std::uint64_t epoch = 0;
    std::shared_ptr<CudaTensors> cuda;
    std::uint64_t last_snapshot = 0;
    std::shared_ptr<ReleaseWords> words;  // set when the session's stream waits use them
  };

  Call CallLocked() REQUIRES(mu) {
    return Call{stub, session, instance, epoch, cuda, last_snapshot, words_in_use ? words : nullptr};
  }

  // Before a GPU session ends: the daemon may still be about to wait on the trainer's
  // events or copy from the tensors of its newest version (and so, in order, of every older
  // one). Waits until that version is captured or failed, so that the trainer may then
  // destroy its events and free the tensors.
  void DrainGpuLocked() REQUIRES(mu) {
    if (!cuda || last_snapshot == 0 || session.empty()) return;
    grpc::ClientContext ctx;
    v1::WaitRequest req;
    v1::WaitReply rep;
    req.set_session(session);
    req.set_version(last_snapshot);
    req.set_level(v1::LEVEL_CAPTURED);
    (void)stub->Wait(&ctx, req, &rep);  // a failed version is as good as a captured one here
  }

  void EndSessionLocked() REQUIRES(mu) {
    session.clear();
    instance.clear();
    cuda.reset();
    trainer_slots = TrainerSlotBook();
    last_snapshot = 0;
    versions.clear();
    daemon_lost = false;
    words_in_use = false;
  }

  // Whether the call that returned `s` on `c` found the daemon gone: the socket refused or
  // broke, or the daemon does not know the session and is another process than the one
  // that made it. Asks the daemon (Status) only for NOT_FOUND.
  static bool DaemonGone(const grpc::Status& s, const Call& c) {
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) return true;
    if (s.error_code() != grpc::StatusCode::NOT_FOUND || c.instance.empty() || !c.stub) return false;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::StatusReply rep;
    grpc::Status st = c.stub->Status(&ctx, v1::StatusRequest(), &rep);
    if (!st.ok()) return st.error_code() == grpc::StatusCode::UNAVAILABLE;
    return rep.daemon_instance() != c.instance;
  }

  // The daemon went away: the session ends with it, and its versions become lost versions
  // (lost unless committed); the registration (table, regions, GPU side) stays for the next.
  void DropSessionLocked() REQUIRES(mu) {
    // A committed one is kept too (nothing to report), so that a wait on it still returns.
    for (const auto& [v, reached] : versions) lost[v] = LostVersion{reached, reached >= Level::kCommitted};
    while (lost.size() > kVersionsTracked) lost.erase(lost.begin());
    versions.clear();
    session.clear();
    instance.clear();
    trainer_slots = cuda ? TrainerSlotBook(kTrainerEventSlots) : TrainerSlotBook();
    last_snapshot = 0;
    daemon_lost = true;
    words_in_use = false;  // the watch stays: the daemon's exit still releases its waits
  }

  v1::RegisterRequest RequestLocked() REQUIRES(mu) {
    v1::RegisterRequest req;
    req.set_job(job);
    req.set_rank(rank);
    req.set_world_size(world_size);
    req.set_descriptor_table(table->name());
    *req.mutable_layouts() = layouts;
    req.set_sealed(options.sealed);
    req.set_verify(options.verify);
    if (cuda) {
      v1::CudaSession* c = req.mutable_cuda();
      c->set_device_uuid(cuda->device_uuid());
      for (std::string& h : cuda->trainer_event_handles()) c->add_trainer_events(std::move(h));
      AddReleaseWordsLocked(c);
    }
    return req;
  }

  std::string LostListLocked() REQUIRES(mu) {
    std::string out;
    for (const auto& [v, l] : lost) {
      if (l.reported || l.reached >= Level::kCommitted) continue;
      out += (out.empty() ? "" : ", ") + std::to_string(v);
    }
    return out;
  }

  // Registers the same table, regions and GPU side again, with a daemon that went away
  // (`cause` says how the client found out), retrying with backoff within the budget.
  // Throws after the budget (UNAVAILABLE), or if the daemon refuses the registration.
  v1::RegisterReply RecoverLocked(const std::string& cause) REQUIRES(mu) {
    if (!daemon_lost) DropSessionLocked();
    const std::string in_flight = LostListLocked();
    const std::string lost_note =
        in_flight.empty() ? "" : "; versions not known committed then: " + in_flight;
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
      v1::RegisterRequest req = RequestLocked();
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
          s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED && s.error_code() != grpc::StatusCode::CANCELLED) {
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

  // The daemon accepted a registration made after it went away.
  void InstallSessionLocked(const std::shared_ptr<v1::Checkpoint::Stub>& fresh, const v1::RegisterReply& rep)
      REQUIRES(mu) {
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

  // The device of session `c` cannot wait on memory: its waits use the daemon's events.
  void ReleaseWordsUnsupported(const Call& c) {
    MutexLock lock(mu);
    if (c.epoch != epoch) return;
    words_in_use = false;
    words_unused = "the device cannot wait on memory (cuStreamWaitValue32: CUDA_ERROR_NOT_SUPPORTED)";
  }

  // The session, reconnected first if the daemon went away; throws if not registered.
  Call Current(const std::string& what) {
    MutexLock lock(mu);
    EnsureSessionLocked(what);
    return CallLocked();
  }

  // `what`: the call that needs the session, for messages.
  void EnsureSessionLocked(const std::string& what) REQUIRES(mu) {
    if (!session.empty()) return;
    if (daemon_lost) {
      RecoverLocked(what + " (the daemon was gone at an earlier call)");
      return;
    }
    throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION),
                "not registered: call register_items first");
  }

  // A call on `c` found the daemon gone: registers again unless another thread already did.
  void Recover(const Call& c, const std::string& cause) {
    MutexLock lock(mu);
    if (epoch != c.epoch && !session.empty()) return;
    RecoverLocked(cause);
  }

  // A Wait RPC on `version`, made on `c`, returned `s` (`rep`): notes what it tells.
  void WaitReturned(const Call& c, std::uint64_t version, const grpc::Status& s, const v1::WaitReply& rep) {
    MutexLock lock(mu);
    if (c.epoch != epoch || c.session != session) return;
    if (WaitReleasesSlot(s.error_code())) trainer_slots.Release(version);
    if (!s.ok()) return;
    auto it = versions.find(version);
    if (it != versions.end()) it->second = std::max(it->second, LevelFromProto(rep.reached()));
  }

  // The snapshot of `version` was taken in the session of `c`.
  void SnapshotTaken(const Call& c, std::uint64_t version) {
    MutexLock lock(mu);
    if (c.epoch != epoch) return;
    versions[version] = Level::kNone;
    while (versions.size() > kVersionsTracked) versions.erase(versions.begin());
    lost.erase(version);
  }

  // Brings the lost versions up to what the daemon finds on storage. Returns a note for
  // messages: the newest committed version, or why the daemon could not be asked.
  std::string RefreshLostLocked() REQUIRES(mu) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ListRequest req;
    req.set_job(job);
    v1::ListReply rep;
    grpc::Status s = stub->List(&ctx, req, &rep);
    if (!s.ok()) return "the restarted daemon could not list job '" + job + "': " + s.error_message();
    for (const auto& v : rep.versions()) {
      auto it = lost.find(v.version());
      if (it == lost.end()) continue;
      it->second.reached = std::max(it->second.reached, LevelOnStorage(v, rank));
      if (it->second.reached >= Level::kCommitted) it->second.reported = true;  // not lost after all
    }
    return "newest committed version: " + std::to_string(rep.latest());
  }

  // The error naming `first` (if set) and every other lost version not yet reported, which
  // are reported by it; null if there is nothing to report. Call RefreshLostLocked first.
  std::optional<DaemonRestartedError> LossReportLocked(std::optional<std::uint64_t> first,
                                                       const std::string& note) REQUIRES(mu) {
    std::vector<std::uint64_t> named;
    std::string msg;
    auto add = [&](std::uint64_t v, LostVersion& l) {
      msg += (msg.empty() ? "daemon restarted; " : "; ") + LostPhrase(v, l.reached);
      named.push_back(v);
      l.reported = true;
    };
    if (first) add(*first, lost.at(*first));
    for (auto& [v, l] : lost) {
      if (!l.reported && l.reached < Level::kCommitted) add(v, l);
    }
    if (named.empty()) return std::nullopt;
    std::sort(named.begin(), named.end());
    return DaemonRestartedError(msg + " (" + note + ")", std::move(named));
  }

  // Whether the restarted daemon finds `version` committed; if so it counts as a lost
  // version that committed (waits on it return).
  bool CommittedAfterRestart(std::uint64_t version) {
    MutexLock lock(mu);
    if (lost.count(version) != 0) return false;
    lost[version] = LostVersion{Level::kNone, true};
    (void)RefreshLostLocked();
    if (lost[version].reached >= Level::kCommitted) return true;
    lost.erase(version);
    return false;
  }

  bool HasUnreportedLossLocked() REQUIRES(mu) {
    for (const auto& [v, l] : lost) {
      if (!l.reported && l.reached < Level::kCommitted) return true;
    }
    return false;
  }

  // A wait for `version` at `level`: if the version was lost to a restart, answers it from
  // what is known (true: reached) or throws its DaemonRestartedError; false if not lost.
  bool AnswerLost(std::uint64_t version, Level level) {
    MutexLock lock(mu);
    if (versions.count(version) != 0) return false;
    auto it = lost.find(version);
    if (it == lost.end()) return false;
    if (it->second.reached >= level) return true;
    const std::string note = RefreshLostLocked();
    if (it->second.reached >= level) return true;
    throw *LossReportLocked(version, note);
  }

  // Keeps a wait_snapshot's stall for the next snapshot to report; returns it.
  std::chrono::nanoseconds NoteStall(std::chrono::nanoseconds stall) {
    unreported_stall_ns.store(static_cast<std::int64_t>(stall.count()), std::memory_order_relaxed);
    return stall;
  }

  // A wait for `version` at `level`, stream-ordered if asked and possible (*ordered says
  // whether it was), on the current session, reconnecting when the daemon went away meanwhile.
  // Returns false if answered from the lost versions (then `rep` is untouched), true if by
  // the daemon on session *used.
  bool Wait(std::uint64_t version, Level level, std::chrono::milliseconds timeout, bool stream_ordered,
            const std::string& what, Call* used, bool* ordered, v1::WaitReply* rep, bool seal = false) {
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
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&& other) noexcept {
  if (this != &other) {
    if (impl_) {
      try {
        unregister();  // the registration being replaced ends, as in the destructor
      } catch (const Error&) {
      }
    }
    impl_ = std::move(other.impl_);
  }
  return *this;
}

Client::~Client() {
  if (!impl_) return;
  try {
    unregister();
  } catch (const Error&) {
    // The daemon may be gone; the registration dies with it.
  }
}

Client Client::connect(const std::string& socket_path, const ClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->socket_path = socket_path.empty() ? DefaultClientSocketPath() : socket_path;
  impl->reconnect_budget = ReconnectBudget(options);
  impl->initial_backoff = options.reconnect_initial_backoff;
  impl->max_backoff = options.reconnect_max_backoff;
  {
    MutexLock lock(impl->mu);
    impl->stub = NewStub(impl->socket_path);
  }
  return Client(std::move(impl));
}

const std::string& Client::socket_path() const { return impl_->socket_path; }

std::chrono::milliseconds Client::reconnect_budget() const { return impl_->reconnect_budget; }

std::string Client::stream_wait() const {
  MutexLock lock(impl_->mu);
  if (!impl_->cuda || impl_->session.empty()) return "none: no GPU registration with a daemon";
  if (impl_->words_in_use) return "release words";
  return "daemon events: " + impl_->words_unused;
}

Registration Client::register_items(const std::string& job, std::uint32_t rank, std::uint32_t world_size,
                                    const std::vector<TensorItem>& items, const RegisterOptions& options) {
  MutexLock lock(impl_->mu);
  std::vector<TableItem> rows;
  std::vector<Impl::Registered> registered;
  std::vector<CudaTensorSpec> gpu_tensors;
  std::vector<std::size_t> gpu_rows;  // index in `rows` of each GPU tensor
  google::protobuf::RepeatedPtrField<v1::ItemLayout> layouts;
  for (const auto& it : items) {
    if (it.layout) {
      v1::ItemLayout* l = layouts.Add();
      l->set_item(it.name);
      l->set_global_name(it.layout->global_name);
      for (auto d : it.layout->global_shape) l->add_global_shape(d);
      for (auto o : it.layout->offsets) l->add_offsets(o);
      l->set_replicated(it.layout->replicated);
    }
    if (it.region && it.cuda_ptr) {
      throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT),
                  "item '" + it.name + "' has both a region and a cuda_ptr: set one of them");
    }
    if (!it.region && !it.cuda_ptr) {
      throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT),
                  "item '" + it.name + "' has no region");
    }
    std::uint64_t elems = 1;
    for (auto d : it.shape) {
      if (d < 0)
        throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT),
                    "item '" + it.name + "' has a negative dimension");
      elems *= static_cast<std::uint64_t>(d);
    }
    TableItem row;
    row.name = it.name;
    row.dtype = it.dtype;
    row.shape = it.shape;
    row.length = elems * ElementSize(it.dtype);
    if (it.cuda_ptr) {
      // Region, offset and generation come from the tensor's CUDA allocation, below.
      gpu_rows.push_back(rows.size());
      gpu_tensors.push_back(CudaTensorSpec{it.name, it.cuda_ptr, row.length});
      rows.push_back(std::move(row));
      continue;
    }
    row.region = it.region->name();
    row.offset = it.offset;
    row.generation = it.region->generation();
    rows.push_back(std::move(row));
    // One entry per distinct region: the check before each snapshot is per region.
    bool seen = false;
    for (const auto& r : registered) seen = seen || r.region == it.region;
    if (!seen) registered.push_back({it.region, it.region->generation(), it.region->size(), it.name});
  }
  // GPU tensors are checked and exported before anything changes: a refused registration
  // leaves the previous one in place.
  std::shared_ptr<CudaTensors> gpu;
  if (!gpu_tensors.empty()) {
    auto resolved = ResolveGpuTensors(gpu_tensors);
    if (!resolved.ok()) ThrowWithCode(resolved.status());
    gpu = std::move(resolved).value();
    for (std::size_t i = 0; i < gpu_rows.size(); ++i) {
      TableItem& row = rows[gpu_rows[i]];
      row.region = gpu->rows()[i].region;
      row.offset = gpu->rows()[i].offset;
      row.generation = gpu->rows()[i].generation;
    }
  }
  bool new_session = !impl_->table || impl_->table->capacity() < rows.size();
  bool kept_events = false;
  if (gpu) {
    const CudaTensors* previous = new_session || impl_->session.empty() ? nullptr : impl_->cuda.get();
    auto kept = gpu->PrepareEvents(previous);
    if (!kept.ok()) ThrowWithCode(kept.status().With("register"));
    kept_events = kept.value();
    impl_->PrepareReleaseWordsLocked(*gpu);
  }
  // A session keeps the CUDA side it registered with (device, trainer events): the daemon
  // may still be waiting on those events. When that side changes, a new session starts.
  if ((gpu || impl_->cuda) && !kept_events) new_session = true;
  if (!impl_->table || impl_->table->capacity() < rows.size()) {
    auto table =
        DescriptorTable::Create("", static_cast<std::uint32_t>(std::max<std::size_t>(rows.size(), 16)));
    if (!table.ok()) Throw(table.status());
    impl_->table = std::move(table).value();
  }
  if (new_session && !impl_->session.empty()) {
    // A new table object, or another CUDA side, means a new registration.
    impl_->DrainGpuLocked();
    UnregisterQuietly(*impl_->stub, impl_->session);
    impl_->EndSessionLocked();
  }
  if (Status s = impl_->table->Write(rows); !s.ok()) Throw(s);
  impl_->options = options;
  impl_->registered = std::move(registered);
  impl_->layouts = std::move(layouts);
  impl_->cuda = gpu;
  if (gpu && !kept_events) impl_->trainer_slots = TrainerSlotBook(kTrainerEventSlots);
  if (impl_->job != job || impl_->rank != rank) impl_->lost.clear();  // another registration's versions
  Registration out;
  v1::RegisterReply rep;
  if (!impl_->daemon_lost) {
    // First registration, or (same table, new generation) a re-registration that the daemon
    // validates now rather than at the next snapshot.
    grpc::ClientContext ctx;
    v1::RegisterRequest req;
    req.set_job(job);
    req.set_rank(rank);
    req.set_world_size(world_size);
    req.set_descriptor_table(impl_->table->name());
    req.set_session(impl_->session);
    *req.mutable_layouts() = impl_->layouts;
    req.set_sealed(options.sealed);
    req.set_verify(options.verify);
    if (gpu) {
      v1::CudaSession* cuda = req.mutable_cuda();
      cuda->set_device_uuid(gpu->device_uuid());
      for (std::string& h : gpu->trainer_event_handles()) cuda->add_trainer_events(std::move(h));
      impl_->AddReleaseWordsLocked(cuda);
    }
    grpc::Status s = impl_->stub->Register(&ctx, req, &rep);
    const bool reregister = !impl_->session.empty();
    if (!s.ok()) {
      // Only a daemon that served this client is waited for; the first registration with
      // no daemon fails at once.
      if (!impl_->served || !Impl::DaemonGone(s, impl_->CallLocked()))
        Throw(s, reregister ? "re-register" : "register");
      impl_->DropSessionLocked();
    } else {
      impl_->served = true;
      if (rep.session() != impl_->session) ++impl_->epoch;
      impl_->session = rep.session();
      impl_->instance = rep.daemon_instance();
      impl_->job = job;
      impl_->rank = rank;
      impl_->world_size = world_size;
      if (gpu) {
        std::vector<std::string> handles(rep.daemon_events().begin(), rep.daemon_events().end());
        if (Status st = gpu->OpenDaemonEvents(handles); !st.ok()) {
          // Without the daemon's events no stream could be ordered after its copies: end the
          // registration rather than leave it half made.
          UnregisterQuietly(*impl_->stub, impl_->session);
          impl_->EndSessionLocked();
          ThrowWithCode(st.With("register"));
        }
        impl_->UseReleaseWordsLocked(rep);
      }
    }
  }
  if (impl_->daemon_lost) {
    impl_->job = job;
    impl_->rank = rank;
    impl_->world_size = world_size;
    rep = impl_->RecoverLocked("register job " + job + " rank " + std::to_string(rank));
  }
  out.item_count = rep.item_count();
  out.tensor_bytes = rep.tensor_bytes();
  out.latest_committed = rep.latest_committed();
  out.sealed = rep.sealed();
  out.verify = rep.verify();
  return out;
}

void Client::snapshot(std::uint64_t version, const std::vector<Blob>& blobs, void* cuda_stream) {
  const std::string what = "snapshot " + std::to_string(version);
  bool retried = false;  // after a daemon restart found by this call
  const std::int64_t stall_ns = impl_->unreported_stall_ns.exchange(-1, std::memory_order_relaxed);
  for (;;) {
    v1::SnapshotRequest req;
    if (stall_ns >= 0) req.set_previous_stall_ns(static_cast<std::uint64_t>(stall_ns));
    Impl::Call call;
    {
      MutexLock lock(impl_->mu);
      for (;;) {
        impl_->EnsureSessionLocked(what);
        // Versions a daemon restart lost are reported before the next snapshot is taken,
        // as the daemon reports a background failure.
        if (impl_->HasUnreportedLossLocked()) {
          const std::string note = impl_->RefreshLostLocked();
          if (auto report =
                  impl_->LossReportLocked(std::nullopt, note + "; reported now; this snapshot of version " +
                                                            std::to_string(version) + " was not taken")) {
            throw *report;
          }
        }
        // A region that was resized (or shrunk by someone else) since registration would
        // make the daemon copy memory that no longer holds the registered tensor.
        for (const auto& r : impl_->registered) {
          auto* posix = dynamic_cast<PosixSharedRegion*>(r.region.get());
          const std::optional<std::uint64_t> now = posix != nullptr ? posix->object_size() : std::nullopt;
          bool shrunk = now && *now != r.size;
          if (r.region->generation() != r.generation || r.region->size() != r.size || shrunk) {
            throw Error(
                static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION),
                "region " + r.region->name() + " of item '" + r.item +
                    "' changed since registration (resized or reallocated); call register_items again");
          }
        }
        if (!impl_->cuda) break;
        // The same for GPU tensors: one freed, or reallocated elsewhere, is not what the
        // daemon imported.
        if (Status s = impl_->cuda->Revalidate(); !s.ok()) ThrowWithCode(s.With(what));
        const std::optional<std::uint64_t> holder = impl_->trainer_slots.MustWaitFor();
        if (!holder) break;
        // The daemon may still wait on the next trainer event for version `holder` (the
        // trainer made no wait on it): wait until the daemon is past it. The version's
        // failure, if any, reached the trainer already (the daemon refuses the next snapshot
        // after a failure it has not reported), so it only frees the slot here.
        const Impl::Call waiting = impl_->CallLocked();
        lock.Unlock();
        v1::WaitReply rep;
        grpc::Status ws = CallWait(*waiting.stub, waiting.session, *holder, v1::LEVEL_CAPTURED,
                                   std::chrono::milliseconds(0), false, &rep);
        const bool gone = !ws.ok() && Impl::DaemonGone(ws, waiting);
        lock.Lock();
        if (waiting.epoch != impl_->epoch || impl_->session.empty()) continue;  // another session now
        if (gone) {
          impl_->DropSessionLocked();  // a new daemon waits on none of the old events
          continue;
        }
        if (!WaitReleasesSlot(ws.error_code())) {
          Throw(ws, what + ": waiting for version " + std::to_string(*holder) + " to release its CUDA event");
        }
        impl_->trainer_slots.Release(*holder);
      }
      req.set_session(impl_->session);
      req.set_table_generation(impl_->table->generation());
      if (impl_->cuda) {
        const std::uint32_t slot = impl_->trainer_slots.next_slot();
        if (Status s = impl_->cuda->RecordTrainerEvent(slot, cuda_stream); !s.ok())
          ThrowWithCode(s.With(what));
        impl_->trainer_slots.Take(version);
        req.set_trainer_event_slot(slot);
      }
      // The daemon may give this version the next release value: the floor covers it before
      // the request leaves (client/release_words.h).
      if (impl_->cuda && impl_->words) impl_->words->NoteSnapshotSent();
      // From now on wait_snapshot_on_stream of older versions waits on the host (the daemon
      // may record their event slots again). After a rollback versions restart lower.
      impl_->last_snapshot = version;
      call = impl_->CallLocked();
    }
    req.set_version(version);
    for (const auto& b : blobs) {
      auto* pb = req.add_blobs();
      pb->set_name(b.name);
      pb->set_data(b.data);
      if (b.for_rank) pb->set_for_rank(*b.for_rank);
    }
    grpc::ClientContext ctx;
    v1::SnapshotReply rep;
    grpc::Status s = call.stub->Snapshot(&ctx, req, &rep);
    if (s.ok()) {
      impl_->SnapshotTaken(call, version);
      return;
    }
    // A daemon stopping gracefully may have taken and committed the version before it
    // refused the call: the restarted one then refuses it as not above the newest commit.
    if (retried && s.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
        impl_->CommittedAfterRestart(version)) {
      return;
    }
    // The state is still that of `version` (the trainer is inside this call): it is taken
    // again by the restarted daemon.
    if (!Impl::DaemonGone(s, call)) Throw(s, what);
    impl_->Recover(call, what + ": " + s.error_message());
    retried = true;
  }
}

std::chrono::nanoseconds Client::wait_snapshot(std::uint64_t version, std::chrono::milliseconds timeout,
                                               bool seal) {
  auto start = std::chrono::steady_clock::now();
  Impl::Call used;
  bool ordered = false;
  v1::WaitReply rep;
  (void)impl_->Wait(version, Level::kCaptured, timeout, false, "wait_snapshot " + std::to_string(version),
                    &used, &ordered, &rep, seal);
  return impl_->NoteStall(std::chrono::steady_clock::now() - start);
}

void Client::report_stall(std::chrono::nanoseconds stall) { (void)impl_->NoteStall(stall); }

void Client::abort_snapshot(std::uint64_t version, const std::string& reason) {
  const std::string what = "abort_snapshot " + std::to_string(version);
  Impl::Call c = impl_->Current(what);
  grpc::ClientContext ctx;
  v1::AbortRequest req;
  v1::AbortReply rep;
  req.set_session(c.session);
  req.set_version(version);
  req.set_reason(reason);
  grpc::Status s = c.stub->Abort(&ctx, req, &rep);
  if (s.ok()) return;
  if (!Impl::DaemonGone(s, c)) Throw(s, what);
  // The session a daemon restart ended never published the version: nothing is left to
  // abort. The client registers again, as any call does after a restart.
  impl_->Recover(c, what + ": " + s.error_message());
}

std::chrono::nanoseconds Client::wait_snapshot_on_stream(std::uint64_t version, void* cuda_stream, bool seal) {
  auto start = std::chrono::steady_clock::now();
  const std::string what = "wait_snapshot_on_stream " + std::to_string(version);
  Impl::Call used;
  bool ordered = false;
  v1::WaitReply rep;
  const bool by_daemon =
      impl_->Wait(version, Level::kCaptured, std::chrono::milliseconds(0), true, what, &used, &ordered, &rep, seal);
  // Without an event the copies had finished when the daemon answered.
  if (by_daemon && ordered && rep.has_daemon_event()) {
    // The release word, which this client can satisfy itself should the daemon die before
    // its copies run; the daemon's event where the words are not in use.
    if (used.words && rep.release_value() != 0) {
      auto waited = used.cuda->WaitReleaseWord(&used.words->word(rep.daemon_event_slot()),
                                               rep.release_value(), cuda_stream);
      if (!waited.ok()) ThrowWithCode(waited.status().With(what));
      if (waited.value()) return impl_->NoteStall(std::chrono::steady_clock::now() - start);
      impl_->ReleaseWordsUnsupported(used);
    }
    if (Status st = used.cuda->WaitDaemonEvent(rep.daemon_event_slot(), cuda_stream); !st.ok()) {
      ThrowWithCode(st.With(what));
    }
  }
  return impl_->NoteStall(std::chrono::steady_clock::now() - start);
}

void Client::wait_durable(std::uint64_t version, Level level, std::chrono::milliseconds timeout) {
  Impl::Call used;
  bool ordered = false;
  v1::WaitReply rep;
  // A wait for durability implies the wait for the capture, and seals as that one does.
  (void)impl_->Wait(version, level, timeout, false, "wait_durable " + std::to_string(version), &used,
                    &ordered, &rep, /*seal=*/true);
}

RestoreResult Client::restore(std::optional<std::uint64_t> version) {
  const std::string what =
      version ? "restore version " + std::to_string(*version) : std::string("restore latest");
  for (;;) {
    Impl::Call c = impl_->Current(what);
    // The daemon writes GPU tensors into the allocations it imported: one freed since
    // registration may hold other data now.
    if (c.cuda) {
      if (Status st = c.cuda->Revalidate(); !st.ok()) ThrowWithCode(st.With("restore"));
      // The daemon writes on its own streams, which are not ordered after work the trainer
      // still has queued on these tensors (initialisation, a copy from the host).
      if (Status st = c.cuda->SynchronizeDevice(); !st.ok()) ThrowWithCode(st.With("restore"));
    }
    grpc::ClientContext ctx;
    v1::RestoreRequest req;
    v1::RestoreReply rep;
    req.set_session(c.session);
    req.set_version(version.value_or(0));
    grpc::Status s = c.stub->Restore(&ctx, req, &rep);
    if (!s.ok()) {
      // A restore cut off by the daemon going away is made again, whole, by the new one.
      if (!Impl::DaemonGone(s, c)) Throw(s, what);
      impl_->Recover(c, what + ": " + s.error_message());
      continue;
    }
    RestoreResult out;
    out.version = rep.version();
    out.tensor_bytes = rep.tensor_bytes();
    out.tier = rep.tier();
    out.world_size = rep.world_size();
    out.resharded = rep.resharded();
    out.uncommitted = rep.uncommitted();
    for (const auto& b : rep.blobs()) {
      out.blobs.push_back(Blob{b.name(), b.data(), std::nullopt, b.from_rank()});
      if (b.has_for_rank()) out.blobs.back().for_rank = b.for_rank();
    }
    return out;
  }
}

DaemonStatus Client::status() {
  std::shared_ptr<v1::Checkpoint::Stub> stub;
  {
    MutexLock lock(impl_->mu);
    stub = impl_->stub;
  }
  grpc::ClientContext ctx;
  v1::StatusRequest req;
  v1::StatusReply rep;
  grpc::Status s = stub->Status(&ctx, req, &rep);
  if (!s.ok()) Throw(s, "status");
  DaemonStatus out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.always_print_primitive_fields = true;
  opts.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(rep, &out.json, opts);
  return out;
}

void Client::unregister() {
  MutexLock lock(impl_->mu);
  impl_->lost.clear();
  if (impl_->session.empty()) {
    impl_->EndSessionLocked();  // a registration whose daemon went away ends here too
    return;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::UnregisterRequest req;
  v1::UnregisterReply rep;
  req.set_session(impl_->session);
  impl_->DrainGpuLocked();
  std::shared_ptr<v1::Checkpoint::Stub> stub = impl_->stub;
  impl_->EndSessionLocked();
  grpc::Status s = stub->Unregister(&ctx, req, &rep);
  // A session unknown to the daemon, or a daemon gone, ended the registration already.
  if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND &&
      s.error_code() != grpc::StatusCode::UNAVAILABLE) {
    Throw(s, "unregister");
  }
}

}  // namespace ckpt

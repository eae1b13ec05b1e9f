#include "daemon/session/registrar.h"

#include <spdlog/spdlog.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <random>
#include <system_error>
#include <thread>

namespace ckpt {
namespace {

std::string NewSessionId() {
  static Mutex mu;
  static std::random_device rd;
  static std::mt19937_64 gen(rd());
  MutexLock lock(mu);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(gen()),
                static_cast<unsigned long long>(gen()));
  return buf;
}

// Faults in the pages of the session's host regions where its items lie (no byte changes;
// ImportedRegion::Prefault), in 64 MiB pieces spread over two threads: page faults into one
// object, unlike writes, run side by side. Stops between pieces once `stop` is set; only
// items whose every piece was done are recorded as preallocated (the restore allocates the
// others itself).
void PrefaultRegions(Session& s, const std::atomic<bool>& stop) {
  struct Piece {
    std::size_t item;
    const ImportedRegion* region;
    std::uint64_t offset, length;
  };
  constexpr std::uint64_t kPiece = 64ull << 20;
  MutexLock lock(s.mu);
  std::vector<Piece> pieces;
  for (std::size_t i = 0; i < s.items.size() && i < s.item_regions.size(); ++i) {
    const auto& region = s.item_regions[i];
    if (!region || region->device() >= 0) continue;
    for (std::uint64_t at = 0; at < s.items[i].length; at += kPiece) {
      pieces.push_back({i, region.get(), s.items[i].offset + at, std::min(kPiece, s.items[i].length - at)});
    }
  }
  std::vector<std::atomic<bool>> done(pieces.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t k = next.fetch_add(1); k < pieces.size() && !stop.load(); k = next.fetch_add(1)) {
      pieces[k].region->Prefault(pieces[k].offset, pieces[k].length);
      done[k].store(true);
    }
  };
  std::thread helper;
  if (pieces.size() > 1 && std::thread::hardware_concurrency() > 1) {
    try {
      helper = std::thread(work);
    } catch (const std::system_error&) {
      // No thread to be had (a process or cgroup limit): this one does it all.
    }
  }
  work();
  if (helper.joinable()) helper.join();
  std::vector<bool> item_done(s.items.size(), true);
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    if (!done[k].load()) item_done[pieces[k].item] = false;
  }
  for (std::size_t i = 0; i < s.items.size() && i < s.item_regions.size(); ++i) {
    const auto& region = s.item_regions[i];
    if (!region || region->device() >= 0 || !item_done[i]) continue;
    s.preallocated.push_back({region, s.items[i].offset, s.items[i].length});
  }
}

}  // namespace

Registered Registrar::Reply(const std::shared_ptr<Session>& s, std::vector<std::string> daemon_events) {
  Registered out;
  out.session = s;
  out.items = static_cast<std::uint32_t>(s->items.size());
  out.tensor_bytes = s->tensor_bytes;
  out.daemon_events = std::move(daemon_events);
  out.latest_committed = catalog_.Latest(s->job);
  out.release_words = s->events && s->events->writes_release_words();
  out.sealed = s->sealed;
  out.verify = s->verify;
  return out;
}

Result<Registered> Registrar::Reregister(const std::shared_ptr<Session>& s, const RegistrationRequest& req,
                                         const CancelCheck& cancelled) {
  if (s->job != req.job || s->rank != req.rank || s->world_size != req.world_size ||
      s->table->name() != req.descriptor_table) {
    return InvalidArgument("re-registration must keep the session's job, rank, world size and table");
  }
  auto ticket = in_flight_.Enter(s->peer.uid);
  if (!ticket.ok()) return ticket.status();
  MutexLock lock(s->mu);
  const bool device = s->device >= 0;
  if (device) {
    if (Status st = sessions_.AwaitCaptured(*s, cancelled); !st.ok()) return st;
  }
  s->preallocated.clear();  // the table may name other regions now
  if (Status st = loader_.Load(*s, &req.layouts); !st.ok()) return st;
  std::vector<std::string> events;
  if (Status st = loader_.AttachDevice(*s, req.device, &events); !st.ok()) return st;
  // Versions already snapshotted keep the seal rule they were taken under.
  s->sealed = req.sealed || req.verify;
  s->verify = req.verify;
  // Load let go of the regions the new table no longer names.
  if (device || s->device >= 0) sessions_.AwaitReleases(*s, "re-registration");
  return Reply(s, std::move(events));
}

Result<Registered> Registrar::Register(const RegistrationRequest& req, const PeerCredentials& peer,
                                       const CancelCheck& cancelled) {
  auto ticket = in_flight_.Enter(peer.uid);
  if (!ticket.ok()) return ticket.status();
  if (Status st = owners_.CheckAccess(req.job, peer, "register"); !st.ok()) return st;
  auto session = std::make_shared<Session>();
  session->id = NewSessionId();
  session->job = req.job;
  session->rank = req.rank;
  session->world_size = req.world_size;
  session->peer = peer;
  session->pidfd.reset(static_cast<int>(::syscall(SYS_pidfd_open, peer.pid, 0)));
  auto table = loader_.OpenTable(req.descriptor_table, peer.uid);
  if (!table.ok()) return table.status();
  session->table = std::move(table).value();
  // Until the session is published (and closing it gives them back), its items count here.
  struct ReleaseItems {
    ItemBudget& items;
    const std::string& id;
    bool armed = true;
    ~ReleaseItems() {
      if (armed) items.Release(id);
    }
  } release_items{items_, session->id};
  std::vector<std::string> events;
  {
    MutexLock lock(session->mu);
    if (Status st = loader_.Load(*session, &req.layouts); !st.ok()) return st;
    if (Status st = loader_.AttachDevice(*session, req.device, &events); !st.ok()) return st;
    session->sealed = req.sealed || req.verify;
    session->verify = req.verify;
  }
  // A new job becomes the caller's; its directory exists (durably) before any shard is
  // written into it.
  if (Status st = owners_.Claim(session->job, peer); !st.ok()) return st;

  // A new registration of the rank makes its earlier shards stop counting towards commits
  // (see Catalog); the newest one in flight, which a restart restores, finishes (and
  // commits, if its version is complete) first. Older ones are not waited for: the newest
  // supersedes them (their queued promotions are skipped when the registration is written).
  // A restart must not wait behind its older versions' promotions: they go out of the way.
  // Not while a live trainer holds the rank (this registration is then refused).
  bool rank_free = true;
  for (const auto& other : sessions_.All()) {
    if (other->job != req.job || other->rank != req.rank) continue;
    if (!other->TrainerExited()) {
      rank_free = false;
    } else {
      // Closed now rather than at the reaper's next round: closing drops the versions it
      // never sealed, which the wait below would otherwise wait for.
      sessions_.Close(other, /*trainer_gone=*/true);
    }
  }
  auto older_go = [this, rank_free](const ShardMeta& m) {
    if (promoter_ && rank_free) promoter_->SupersedeRankBelow(m.job, m.rank, m.version);
  };
  // --restart-waits none: nothing is waited for; the registration below skips the rank's
  // promotions still queued or running (they could no longer commit), and the restore takes
  // the newest version committed by then.
  if (restart_waits_newest_) {
    const auto wait_start = std::chrono::steady_clock::now();
    std::uint64_t waited_for = 0;  // the version whose shard the wait ended on (0: none)
    bool in_flight = false;        // whether one was still on its way when the wait began
    // While the restart waits for its newest version, the pages of its regions are faulted
    // in (ImportedRegion::Prefault: no byte changes), which the restore that typically
    // follows would otherwise pay for in its copy. A wait that ends normally lets the
    // faulting finish (the restore then writes into memory in use); one that fails or is
    // cancelled stops it between pieces.
    std::thread preallocate;
    std::atomic<bool> wait_over{false}, abandon{false};
    auto waiting_for = [&](const ShardMeta& m) {
      older_go(m);
      waited_for = m.version;
      if (preallocate.joinable() || !rank_free) return;
      std::shared_ptr<ShardJob> waited;
      for (const auto& shard : shards_.Version(m.job, m.version)) {
        if (shard->meta().rank == m.rank && shard->level() < Level::kPersisted && !shard->failed()) waited = shard;
      }
      if (!waited) return;
      in_flight = true;
      spdlog::info("job {} rank {}: restart waits for version {}, still on its way; its regions are faulted in meanwhile",
                   m.job, m.rank, m.version);
      // The faulting starts once that version is out of the dead trainer's memory: its
      // shared memory is then let go, and the new regions take the pages it gave back,
      // pages in use a moment ago rather than ones the kernel (or, in a virtual machine,
      // the host) has to find or zero first. The capture precedes the persist the wait
      // ends on, so this wait ends within it.
      preallocate = std::thread([&session, &wait_over, &abandon, waited] {
        // In slices, so that a wait that ends first (cancelled, or the shard failed) is not
        // held up by this one.
        while (!wait_over.load() && waited->level() < Level::kCaptured && !waited->failed()) {
          (void)waited->WaitFor(Level::kCaptured, std::chrono::steady_clock::now() + std::chrono::milliseconds(50));
        }
        if (wait_over.load()) return;
        const auto started = std::chrono::steady_clock::now();
        PrefaultRegions(*session, abandon);
        spdlog::info("job {} rank {}: regions faulted in for the restore in {:.1f} ms", session->job, session->rank,
                     std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count());
      });
    };
    Status st = shards_.WaitRankNewestSettled(session->job, session->rank, cancelled, waiting_for);
    const auto wait_end = std::chrono::steady_clock::now();
    wait_over.store(true);
    if (!st.ok()) abandon.store(true);
    if (preallocate.joinable()) preallocate.join();
    if (!st.ok()) return st;
    if (waited_for != 0) {
      using Ms = std::chrono::duration<double, std::milli>;
      spdlog::info("job {} rank {}: restart waited {:.1f} ms for version {} of its earlier registration{}, then "
                   "{:.1f} ms for its regions to be faulted in",
                   session->job, session->rank, Ms(wait_end - wait_start).count(), waited_for,
                   in_flight ? " (in flight when it registered)" : "",
                   Ms(std::chrono::steady_clock::now() - wait_end).count());
    }
  }
  std::shared_ptr<Session> replaced;
  if (Status st = sessions_.Add(session, &replaced); !st.ok()) return st;
  release_items.armed = false;
  Registered out;
  {
    MutexLock lock(session->mu);
    if (Status st = NewRegistration(*session); !st.ok()) {
      sessions_.Close(session, /*trainer_gone=*/false);
      return st.With("record the registration of rank " + std::to_string(session->rank));
    }
    out = Reply(session, std::move(events));
  }
  if (replaced) sessions_.Close(replaced, /*trainer_gone=*/true);
  spdlog::info("registered job {} rank {}/{} pid {}: {} items, {} bytes", session->job, session->rank,
               session->world_size, peer.pid, out.items, out.tensor_bytes);
  return out;
}

Status Registrar::NewRegistration(Session& s) {
  std::string id = s.id + "." + std::to_string(++s.registrations);
  if (Status st = catalog_.WriteRankRegistration(s.job, s.rank, id); !st.ok()) return st;
  s.registration = std::move(id);
  if (promoter_) promoter_->RankRegistered(s.job, s.rank);
  return Status::Ok();
}

}  // namespace ckpt

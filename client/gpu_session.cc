// The GPU side of a session: the release words that stream-ordered waits use where the
// daemon and the device allow (client/release_words.h), and the drain of the daemon's copies
// before a GPU session ends.
#include <sys/types.h>

#include <utility>
#include <vector>

#include "client/session.h"

namespace ckpt {

Client::Impl::~Impl() {
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

void Client::Impl::PrepareReleaseWordsLocked(CudaTensors& gpu) {
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

void Client::Impl::AddReleaseWordsLocked(v1::CudaSession* c) {
  if (!words_mapping) return;
  c->set_release_words(words->name());
  c->set_release_base(words->SessionBase());
}

void Client::Impl::UseReleaseWordsLocked(const v1::RegisterReply& rep) {
  words_in_use = false;
  if (!words_mapping) return;
  if (!rep.release_words()) {
    words_unused = "ckptd does not write them (see its log)";
    return;
  }
  if (Status st = watch->Watch(static_cast<pid_t>(rep.daemon_pid()), rep.daemon_pid_namespace()); !st.ok()) {
    words_unused = "ckptd's process cannot be watched: " + st.message();
    return;
  }
  words_in_use = true;
}

void Client::Impl::ReleaseWordsUnsupported(const Call& c) {
  MutexLock lock(mu);
  if (c.epoch != epoch) return;
  words_in_use = false;
  words_unused = "the device cannot wait on memory (cuStreamWaitValue32: CUDA_ERROR_NOT_SUPPORTED)";
}

void Client::Impl::DrainGpuLocked() {
  if (!cuda || last_snapshot == 0 || session.empty()) return;
  grpc::ClientContext ctx;
  v1::WaitRequest req;
  v1::WaitReply rep;
  req.set_session(session);
  req.set_version(last_snapshot);
  req.set_level(v1::LEVEL_CAPTURED);
  (void)stub->Wait(&ctx, req, &rep);  // a failed version is as good as a captured one here
}

}  // namespace ckpt

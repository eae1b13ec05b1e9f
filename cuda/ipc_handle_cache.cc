#include "cuda/ipc_handle_cache.h"

#include <utility>
#include <vector>

#include "common/mutex.h"

namespace ckpt::cuda {

struct IpcHandleCache::State {
  struct Entry {
    std::uint64_t serial = 0;
    std::shared_ptr<const IpcMapping> mapping;
    std::uint32_t refs = 0;
  };

  explicit State(std::shared_ptr<IpcOpener> o) : opener(std::move(o)) {}

  std::shared_ptr<IpcOpener> opener;
  mutable Mutex mu;
  std::map<Key, Entry> entries GUARDED_BY(mu);
  std::uint64_t next_serial GUARDED_BY(mu) = 1;
};

std::string IpcHandle::Hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(kBytes * 2);
  for (std::uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xf]);
  }
  return out;
}

Result<IpcHandle> IpcHandle::FromHex(std::string_view hex) {
  if (hex.size() != kBytes * 2) {
    return InvalidArgument("a CUDA IPC handle is " + std::to_string(kBytes * 2) + " hex digits, not " +
                           std::to_string(hex.size()));
  }
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  IpcHandle h;
  for (std::size_t i = 0; i < kBytes; ++i) {
    int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return InvalidArgument("a CUDA IPC handle must be hex digits only");
    h.bytes[i] = static_cast<std::uint8_t>(hi << 4 | lo);
  }
  return h;
}

IpcHandleCache::Registration& IpcHandleCache::Registration::operator=(Registration&& other) noexcept {
  if (this != &other) {
    Reset();
    state_ = std::move(other.state_);
    key_ = other.key_;
    serial_ = std::exchange(other.serial_, 0);
    info_ = other.info_;
    mapping_ = std::move(other.mapping_);
  }
  return *this;
}

void IpcHandleCache::Registration::Reset() {
  if (serial_ == 0) return;
  std::shared_ptr<const IpcMapping> dropped;  // closed, if last, after the lock is released
  if (auto state = state_.lock()) {
    MutexLock lock(state->mu);
    auto it = state->entries.find(key_);
    // A different serial means ReleaseClient dropped our entry (and maybe a new one replaced it).
    if (it != state->entries.end() && it->second.serial == serial_ && --it->second.refs == 0) {
      dropped = std::move(it->second.mapping);
      state->entries.erase(it);
    }
  }
  state_.reset();
  serial_ = 0;
  mapping_.reset();
}

IpcHandleCache::IpcHandleCache(std::shared_ptr<IpcOpener> opener)
    : state_(std::make_shared<State>(std::move(opener))) {}

IpcHandleCache::~IpcHandleCache() {
  std::map<Key, State::Entry> dropped;
  {
    MutexLock lock(state_->mu);
    dropped.swap(state_->entries);
  }
}

Result<IpcHandleCache::Registration> IpcHandleCache::Register(pid_t pid, const IpcHandle& handle,
                                                              int device) {
  Key key{pid, handle};
  MutexLock lock(state_->mu);
  auto it = state_->entries.find(key);
  if (it == state_->entries.end()) {
    auto opened = state_->opener->Open(handle, device);
    if (!opened.ok()) return opened.status().With("open CUDA IPC handle of pid " + std::to_string(pid));
    IpcMapping m = opened.value();
    m.device = device;
    // The deleter closes the handle when the last holder (the cache entry or a copy in
    // flight) lets go; it keeps the opener alive for that.
    std::shared_ptr<IpcOpener> opener = state_->opener;
    auto mapping = std::shared_ptr<const IpcMapping>(new IpcMapping(m), [opener](const IpcMapping* p) {
      (void)opener->Close(*p);  // nothing useful can be done about a failed close
      delete p;
    });
    State::Entry entry;
    entry.serial = state_->next_serial++;
    entry.mapping = std::move(mapping);
    it = state_->entries.emplace(key, std::move(entry)).first;
  } else if (it->second.mapping->device != device) {
    return InvalidArgument("CUDA IPC handle of pid " + std::to_string(pid) + " is already open on device " +
                           std::to_string(it->second.mapping->device) + ", not device " +
                           std::to_string(device));
  }
  ++it->second.refs;
  Registration r;
  r.state_ = state_;
  r.key_ = key;
  r.serial_ = it->second.serial;
  r.info_ = *it->second.mapping;
  r.mapping_ = it->second.mapping;
  return r;
}

std::size_t IpcHandleCache::ReleaseClient(pid_t pid) {
  std::vector<std::shared_ptr<const IpcMapping>> dropped;  // closed after the lock is released
  MutexLock lock(state_->mu);
  auto first = state_->entries.lower_bound(Key{pid, IpcHandle{}});
  auto last = first;
  while (last != state_->entries.end() && last->first.pid == pid) {
    dropped.push_back(std::move(last->second.mapping));
    ++last;
  }
  state_->entries.erase(first, last);
  return dropped.size();
}

std::size_t IpcHandleCache::size() const {
  MutexLock lock(state_->mu);
  return state_->entries.size();
}

std::uint32_t IpcHandleCache::references(pid_t pid, const IpcHandle& handle) const {
  MutexLock lock(state_->mu);
  auto it = state_->entries.find(Key{pid, handle});
  return it == state_->entries.end() ? 0 : it->second.refs;
}

}  // namespace ckpt::cuda

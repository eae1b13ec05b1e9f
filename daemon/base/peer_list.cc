#include "daemon/base/peer_list.h"

#include <algorithm>
#include <cstdio>
#include <set>

namespace ckpt {

std::vector<std::size_t> PeerList::Holders() const {
  std::vector<std::size_t> out;
  const std::size_t n = addresses.size();
  for (std::uint32_t k = 1; k <= replicas && k < n; ++k) out.push_back((self + k) % n);
  return out;
}

std::vector<std::size_t> PeerList::Ring() const {
  std::vector<std::size_t> out;
  const std::size_t n = addresses.size();
  for (std::size_t k = 1; k < n; ++k) out.push_back((self + k) % n);
  return out;
}

namespace {

// Splits at commas outside brackets.
std::vector<std::string> SplitTop(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  for (char c : s) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

std::string HostOf(const std::string& addr) {
  if (!addr.empty() && addr.front() == '[') return addr.substr(0, addr.find(']') + 1);
  return addr.substr(0, addr.rfind(':'));
}
std::string PortOf(const std::string& addr) {
  const auto c = addr.rfind(':');
  return c == std::string::npos ? "" : addr.substr(c + 1);
}

}  // namespace

Result<std::vector<std::string>> ExpandSlurmHostList(const std::string& list) {
  std::vector<std::string> out;
  for (const std::string& part : SplitTop(list)) {
    const auto open = part.find('[');
    if (open == std::string::npos) {
      out.push_back(part);
      continue;
    }
    const auto close = part.find(']', open);
    if (close == std::string::npos) return InvalidArgument("Slurm host list '" + list + "': unbalanced '['");
    const std::string prefix = part.substr(0, open), suffix = part.substr(close + 1);
    if (suffix.find('[') != std::string::npos) {
      return InvalidArgument("Slurm host list '" + list + "': more than one bracket in one name");
    }
    for (const std::string& range : SplitTop(part.substr(open + 1, close - open - 1))) {
      const auto dash = range.find('-');
      const std::string lo = range.substr(0, dash);
      const std::string hi = dash == std::string::npos ? lo : range.substr(dash + 1);
      if (lo.empty() || hi.empty() || lo.find_first_not_of("0123456789") != std::string::npos ||
          hi.find_first_not_of("0123456789") != std::string::npos || lo.size() > 9 || hi.size() > 9) {
        return InvalidArgument("Slurm host list '" + list + "': bad range '" + range + "'");
      }
      const long a = std::stol(lo), b = std::stol(hi);
      if (b < a || b - a > 100000) return InvalidArgument("Slurm host list '" + list + "': bad range '" + range + "'");
      for (long i = a; i <= b; ++i) {
        char num[16];
        std::snprintf(num, sizeof num, "%0*ld", static_cast<int>(lo.size()), i);
        out.push_back(prefix + num + suffix);
      }
    }
  }
  return out;
}

Result<PeerList> ResolvePeers(const std::vector<std::string>& peers, const std::string& listen,
                              std::uint32_t replicas, const std::string& slurm_nodelist, const std::string& host) {
  PeerList out;
  out.replicas = replicas;
  if (peers.size() == 1 && peers[0] == "slurm") {
    if (slurm_nodelist.empty()) return InvalidArgument("--peers slurm: $SLURM_JOB_NODELIST is not set");
    auto hosts = ExpandSlurmHostList(slurm_nodelist);
    if (!hosts.ok()) return hosts.status().With("--peers slurm");
    for (const auto& h : hosts.value()) out.addresses.push_back(h + ":" + PortOf(listen));
  } else {
    out.addresses = peers;
  }
  if (out.addresses.empty()) return InvalidArgument("--peers is empty");
  std::set<std::string> seen;
  for (const auto& a : out.addresses) {
    if (a.empty() || PortOf(a).empty()) return InvalidArgument("--peers entry '" + a + "' is not HOST:PORT");
    if (!seen.insert(a).second) return InvalidArgument("--peers names " + a + " twice");
  }
  auto it = std::find(out.addresses.begin(), out.addresses.end(), listen);
  const std::string lhost = HostOf(listen);
  if (it == out.addresses.end() && (lhost == "0.0.0.0" || lhost == "[::]")) {
    std::string shorthost = host.substr(0, host.find('.'));
    it = std::find_if(out.addresses.begin(), out.addresses.end(), [&](const std::string& a) {
      const std::string h = HostOf(a);
      return PortOf(a) == PortOf(listen) && (h == host || h == shorthost);
    });
  }
  if (it == out.addresses.end()) {
    return InvalidArgument("--peers has no entry for this daemon (--peer-listen " + listen +
                           "): list every daemon, this one included, in the same order on all of them");
  }
  out.self = static_cast<std::size_t>(it - out.addresses.begin());
  if (replicas + 1 > out.addresses.size()) {
    return InvalidArgument("--replicas " + std::to_string(replicas) + " needs at least " +
                           std::to_string(replicas + 1) + " daemons in --peers (" +
                           std::to_string(out.addresses.size()) + " given)");
  }
  return out;
}

}  // namespace ckpt

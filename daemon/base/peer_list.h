// PeerList: the daemons that replicate to one another, in the one order they all share,
// and the peer rule.
//
// Rule: with N daemons in the list and R replicas, the daemon at index i sends each shard
// it captures to the daemons at i+1, ..., i+R (mod N). So after a failure every survivor
// can compute who holds what: the replicas of the shards node i captured are on i+1..i+R.
// A restore on daemon i (a replacement takes the place, and the address, of the node it
// replaces) asks the daemons at i+1, i+2, ... in that order: the rule's holders first, then
// the rest (a rank that ran elsewhere before, a spare that took a replica).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace ckpt {

struct PeerList {
  std::vector<std::string> addresses;  // as given, in the shared order
  std::size_t self = 0;                // this daemon's index
  std::uint32_t replicas = 0;

  // The rule's holders of this daemon's shards: self+1..self+R.
  std::vector<std::size_t> Holders() const;
  // Every other daemon, from self+1 on, cyclically.
  std::vector<std::size_t> Ring() const;
  const std::string& self_address() const { return addresses[self]; }
};

// `peers`: the --peers entries ("slurm": the hosts of `slurm_nodelist` with the port of
// `listen`). `host`: this machine's name, to find an entry when `listen` is a wildcard
// address. InvalidArgument saying what is wrong (an empty list, a duplicate, no entry for
// this daemon, R larger than the other daemons).
Result<PeerList> ResolvePeers(const std::vector<std::string>& peers, const std::string& listen,
                              std::uint32_t replicas, const std::string& slurm_nodelist, const std::string& host);

// Expands a Slurm host list ("n[01-03,07],gpu5") into host names, in its order.
Result<std::vector<std::string>> ExpandSlurmHostList(const std::string& list);

}  // namespace ckpt

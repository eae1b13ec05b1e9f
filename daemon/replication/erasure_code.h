// Erasure coding of a shard image for peer redundancy: a Reed-Solomon code over GF(2^8), on
// ISA-L, in two layers.
//
// ErasureCode is the codec. k data fragments of equal size go in, m parity fragments come
// out, and any k of the k+m fragments rebuild the others. Its generator matrix is the
// identity over a Cauchy matrix (gf_gen_cauchy1_matrix): every square submatrix of a
// Cauchy matrix is invertible, so every choice of k surviving fragments decodes, for every
// k+m up to kMaxErasureFragments. (ISA-L's other generator, the Vandermonde one, loses that
// guarantee for some larger k and m.) The encoding tables are built once, at Create; a
// rebuild inverts the k x k submatrix of the surviving rows and builds tables for the rows it
// is asked for. Fragment pointers need no alignment (ISA-L loads unaligned).
//
// The stripe layer cuts one buffer (a shard image) into k data fragments of fragment_bytes
// each, the last ones padded with zeros, adds the m parity fragments and records an xxh3-64
// checksum (format/checksum.h) of every fragment. fragment_bytes is the share of one data
// fragment rounded up to a multiple of kFragmentAlignment (64): the SIMD kernels then run on
// whole vectors, and fragments laid end to end in a received buffer stay cache-line aligned.
// ReconstructStripe checks each fragment it is handed against its checksum, treats one that
// does not match as missing, and rebuilds the buffer from any k intact fragments. Data
// fragments that lie wholly inside the buffer are never copied on encode; on reconstruct, a
// fragment handed in at its own place in the output buffer is not copied either.
//
// Thread-safety: an ErasureCode is immutable after Create; its const methods may run
// concurrently on different fragments. The functions here hold no state of their own.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace ckpt {

// Most fragments (k + m) a code may have.
inline constexpr unsigned kMaxErasureFragments = 32;
// A stripe's fragment_bytes is a multiple of this.
inline constexpr std::uint64_t kFragmentAlignment = 64;

class ErasureCode {
 public:
  // An empty code (k = m = 0) that encodes nothing; Create makes a usable one.
  ErasureCode() = default;

  // A code of k data and m parity fragments. InvalidArgument unless k >= 1, m >= 1 and
  // k + m <= kMaxErasureFragments.
  static Result<ErasureCode> Create(unsigned k, unsigned m);

  unsigned k() const { return k_; }
  unsigned m() const { return m_; }

  // Computes the m parity fragments of the k data fragments, fragment_bytes each. `data`
  // holds k pointers, `parity` m pointers to writable buffers that overlap no data fragment.
  // InvalidArgument if a span has the wrong size or a pointer is null.
  Status Encode(std::span<const std::uint8_t* const> data, std::span<std::uint8_t* const> parity,
                std::uint64_t fragment_bytes) const;

  // Rebuilds missing fragments from the present ones. `fragments` holds k+m pointers in
  // fragment order (data 0..k-1, then parity 0..m-1); nullptr marks a missing one. `out`
  // holds k+m pointers too: out[i] non-null asks for fragment i (which must be missing) to be
  // written there; the others are ignored. Any k present fragments suffice; the first k in
  // fragment order are used. DataLoss, naming the missing fragments, if fewer than k are
  // present; InvalidArgument if a span has the wrong size or out[i] is set for a present one.
  Status Rebuild(std::span<const std::uint8_t* const> fragments, std::span<std::uint8_t* const> out,
                 std::uint64_t fragment_bytes) const;

  // Folds data fragment `index` (< k) into parity fragment `row` (< m): parity ^= its
  // coefficient times data, over `bytes` bytes. Starting from zeros and folding in each data
  // fragment once, in any order, gives what Encode gives; a data fragment never folded in
  // counts as zeros. `bytes` a multiple of kFragmentAlignment. InvalidArgument otherwise.
  Status Accumulate(unsigned index, unsigned row, const std::uint8_t* data, std::uint8_t* parity,
                    std::uint64_t bytes) const;

 private:
  ErasureCode(unsigned k, unsigned m);

  unsigned k_ = 0;
  unsigned m_ = 0;
  // The (k+m) x k generator matrix, row-major: the identity, then the m Cauchy rows.
  std::vector<unsigned char> matrix_;
  // ec_init_tables of the m parity rows: 32 * k * m bytes.
  std::vector<unsigned char> parity_tables_;
};

// How one buffer is spread over k + m fragments, and what each fragment must hash to. Data
// fragment i holds bytes [i * fragment_bytes, (i + 1) * fragment_bytes) of the buffer, zeros
// past its end.
struct Stripe {
  unsigned k = 0;
  unsigned m = 0;
  std::uint64_t length = 0;              // bytes of the buffer
  std::uint64_t fragment_bytes = 0;      // bytes of every fragment, a multiple of kFragmentAlignment
  std::vector<std::uint64_t> checksums;  // k + m: xxh3-64 of each fragment's fragment_bytes bytes
};

// The fragment size of a buffer of `length` bytes cut into k: ceil(length / k) rounded up to
// a multiple of kFragmentAlignment. 0 for an empty buffer.
std::uint64_t StripeFragmentBytes(std::uint64_t length, unsigned k);

// "3 (data)" or "5 (parity)": how messages name fragment i of a code with k data fragments.
std::string FragmentName(unsigned i, unsigned k);

// A buffer encoded: its stripe and the k + m fragments. The data fragments that lie wholly
// inside the buffer point into it (the buffer must outlive this); the others (the padded
// tail) and the parity fragments are owned here. Move-only: the pointers follow the owned
// storage.
class EncodedStripe {
 public:
  EncodedStripe() = default;
  EncodedStripe(EncodedStripe&&) = default;
  EncodedStripe& operator=(EncodedStripe&&) = default;
  EncodedStripe(const EncodedStripe&) = delete;
  EncodedStripe& operator=(const EncodedStripe&) = delete;

  const Stripe& stripe() const { return stripe_; }
  // Fragment i (i < k + m), stripe().fragment_bytes bytes.
  const std::uint8_t* fragment(unsigned i) const { return fragments_[i]; }
  // All k + m fragments, in fragment order.
  std::span<const std::uint8_t* const> fragments() const { return fragments_; }

 private:
  friend Result<EncodedStripe> EncodeStripe(const ErasureCode& code, const void* data, std::uint64_t length);

  Stripe stripe_;
  std::vector<std::uint8_t> tail_;    // the data fragments not wholly inside the buffer, padded
  std::vector<std::uint8_t> parity_;  // m fragments end to end
  std::vector<const std::uint8_t*> fragments_;
};

// Cuts `length` bytes at `data` into the code's k data fragments, computes the m parity
// fragments and checksums all of them. An empty buffer gives fragments of 0 bytes.
// InvalidArgument for an empty code, or a null `data` with a non-zero length.
Result<EncodedStripe> EncodeStripe(const ErasureCode& code, const void* data, std::uint64_t length);

// What ReconstructStripe found wrong with the fragments it was handed, in fragment order.
struct StripeDamage {
  std::vector<unsigned> missing;  // handed in as nullptr
  std::vector<unsigned> corrupt;  // present, but not matching their checksum: treated as missing
  bool intact() const { return missing.empty() && corrupt.empty(); }
};

// Writes the stripe's `stripe.length` bytes to `out` from `fragments` (k + m pointers of
// stripe.fragment_bytes bytes each, nullptr for a missing one, even of 0 bytes). Every present fragment is
// checked against its checksum, and data fragments missing or corrupt are rebuilt from k
// intact ones; the rebuilt ones are checked too. Returns what was missing or corrupt.
// DataLoss naming the missing and the corrupt fragments if fewer than k are intact (`out` is
// then left untouched); InvalidArgument if the code does not match the stripe, the stripe is
// inconsistent, or a span has the wrong size. A fragment may lie in `out` itself, at its own
// offset (then it is not copied), but must overlap no other fragment's place in `out`.
Result<StripeDamage> ReconstructStripe(const ErasureCode& code, const Stripe& stripe,
                                       std::span<const std::uint8_t* const> fragments, void* out);

}  // namespace ckpt

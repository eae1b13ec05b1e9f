#!/usr/bin/env python3
"""Independent check of shard files against the safetensors format.

Written from the format's description (https://github.com/huggingface/safetensors, "Format"),
with the Python standard library only and no code of this project, so that it can catch a
shard that our own reader accepts but other safetensors readers would not:

  8 bytes      N, an unsigned little-endian 64-bit integer: the size of the header
  N bytes      a UTF-8 JSON object, starting with '{', possibly padded with trailing spaces
  rest         the byte buffer

Each header entry other than "__metadata__" is {"dtype", "shape", "data_offsets": [begin, end]}
with offsets relative to the start of the byte buffer; the entries must cover the buffer
exactly (no holes, no overlaps) and each must hold product(shape) elements of its dtype.
"__metadata__", if present, maps strings to strings. On top of the format, ckptd shards put
the buffer on a 4 KiB boundary, so 8 + N must be a multiple of 4096.

Usage: safetensors_spec_check.py [--dump-dir DIR] SHARD...
  --dump-dir DIR  also write each tensor's bytes to DIR/<key, '/' as '%2F'>.bin
Exit status 0 if every shard is valid, 1 otherwise (with the reasons on stderr), 2 on bad usage.
"""

import argparse
import json
import os
import struct
import sys

# Reference implementation's limit on N.
MAX_HEADER_BYTES = 100_000_000
# ckptd's data-section alignment.
DATA_ALIGNMENT = 4096

# Element sizes in bits: the classic types, plus the newer 8-bit exponent float, complex,
# and the sub-byte floats of recent safetensors versions.
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


class SpecError(Exception):
    pass


def _is_uint(value):
    # JSON true/false arrive as bool, which Python counts as int: they are not numbers here.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_duplicate_keys(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise SpecError(f"header has the key {key!r} twice")
        obj[key] = value
    return obj


def parse_header(raw):
    """Parses the N header bytes; returns the JSON object."""
    if not raw.startswith(b"{"):
        raise SpecError(f"header does not start with '{{' (starts with {raw[:8]!r})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"header is not UTF-8: {e}") from None
    decoder = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)
    try:
        header, end = decoder.raw_decode(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"header is not valid JSON: {e}") from None
    padding = text[end:]
    if padding.strip(" ") != "":
        raise SpecError(f"header has {len(padding)} bytes after the JSON object that are not spaces")
    if not isinstance(header, dict):
        raise SpecError("header is not a JSON object")
    return header


def check_entry(key, entry):
    """Validates one tensor entry; returns (begin, end)."""
    if not isinstance(entry, dict):
        raise SpecError(f"entry {key!r} is not an object")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise SpecError(f"entry {key!r} lacks {field!r}")
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise SpecError(f"entry {key!r} has dtype {dtype!r}, not one of the format's types")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise SpecError(f"entry {key!r} has shape {shape!r}, not a list of non-negative integers")
    offsets = entry["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
        raise SpecError(f"entry {key!r} has data_offsets {offsets!r}, not [begin, end]")
    begin, end = offsets
    if end < begin:
        raise SpecError(f"entry {key!r} ends ({end}) before it begins ({begin})")
    elements = 1
    for d in shape:
        elements *= d
    bits = elements * DTYPE_BITS[dtype]
    if bits % 8 != 0:
        raise SpecError(f"entry {key!r}: {elements} elements of {dtype} are not a whole number of bytes")
    if bits // 8 != end - begin:
        raise SpecError(
            f"entry {key!r}: shape {shape} of {dtype} is {bits // 8} bytes but data_offsets span {end - begin}"
        )
    return begin, end


def check_shard(path, dump_dir=None):
    """Validates one file; returns a one-line summary. Raises SpecError."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise SpecError(f"file is {len(data)} bytes, too short for the header size")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES:
        raise SpecError(f"header size {n} is over the limit of {MAX_HEADER_BYTES}")
    if 8 + n > len(data):
        raise SpecError(f"header size {n} does not fit a file of {len(data)} bytes")
    header = parse_header(data[8 : 8 + n])
    buffer_start = 8 + n
    buffer_len = len(data) - buffer_start

    metadata = header.get("__metadata__")
    if "__metadata__" in header:
        if not isinstance(metadata, dict):
            raise SpecError("__metadata__ is not an object")
        for k, v in metadata.items():
            if not isinstance(v, str):
                raise SpecError(f"__metadata__[{k!r}] is {type(v).__name__}, not a string")

    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end = check_entry(key, entry)
        spans.append((begin, end, key))
    spans.sort()
    expect = 0
    for begin, end, key in spans:
        if begin != expect:
            what = "a hole before" if begin > expect else "an overlap at"
            raise SpecError(f"byte buffer has {what} entry {key!r} (begins at {begin}, expected {expect})")
        expect = end
    if expect != buffer_len:
        raise SpecError(
            f"entries cover {expect} bytes but the byte buffer is {buffer_len} "
            f"(file is {len(data)} bytes, expected {buffer_start + expect})"
        )
    if buffer_start % DATA_ALIGNMENT != 0:
        raise SpecError(f"byte buffer starts at {buffer_start}, not on a {DATA_ALIGNMENT}-byte boundary")

    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        for begin, end, key in spans:
            name = key.replace("/", "%2F") + ".bin"
            with open(os.path.join(dump_dir, name), "wb") as out:
                out.write(data[buffer_start + begin : buffer_start + end])
    return f"{path}: ok, {len(spans)} tensors, header {n} bytes, buffer {buffer_len} bytes"


def main(argv):
    parser = argparse.ArgumentParser(description="Check shard files against the safetensors format.")
    parser.add_argument("--dump-dir", help="write each tensor's bytes to DIR/<key with '/' as '%%2F'>.bin")
    parser.add_argument("shards", nargs="+", metavar="SHARD")
    args = parser.parse_args(argv)
    bad = 0
    for path in args.shards:
        try:
            print(check_shard(path, args.dump_dir))
        except SpecError as e:
            print(f"{path}: INVALID: {e}", file=sys.stderr)
            bad += 1
        except OSError as e:
            print(f"{path}: cannot read: {e}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

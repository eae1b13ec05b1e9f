#!/usr/bin/env python3
"""Checks that libckpt exports its public API and nothing else.

The public API is what the installed headers declare: the classes marked CKPT_API
(ckpt/export.h) and the functions declared at namespace scope (ckpt::LevelName). Every
symbol in the library's dynamic symbol table (nm -D --defined-only) must be
  - a member, vtable or typeinfo of one of those classes (not of a private nested type such
    as Client::Impl), or one of those functions; or
  - a weak or unique instantiation of a libstdc++ template (std::, __gnu_cxx::), which every
    C++ library emits and the dynamic linker merges.
Anything else (gRPC, protobuf, abseil, the CUDA runtime, the ckpt.v1 messages, libckpt's
internal classes) is a leak: the check fails and lists it. It also fails when a part of the
API is missing, when the SONAME is not libckpt.so.MAJOR, or when the library file carries
no version.

  exported_symbols.py LIBRARY HEADER...              # check the library
  exported_symbols.py --self-test LIBRARY HEADER...  # the check passes on the library and
                                                     # fails on each of a set of leaks added
                                                     # to its symbols
"""
import os
import re
import subprocess
import sys

# Parts of the API that must be there (demangled prefixes).
REQUIRED = [
    "ckpt::Client::connect(",
    "ckpt::Client::register_items(",
    "ckpt::Client::snapshot(",
    "ckpt::Client::restore(",
    "ckpt::SharedRegion::create(",
    "ckpt::LevelName(",
    "typeinfo for ckpt::Error",
]
# How the demangler names the things a class brings besides its members.
SPECIAL = ("vtable for ", "typeinfo for ", "typeinfo name for ", "VTT for ", "construction vtable for ",
           "non-virtual thunk to ", "virtual thunk to ", "guard variable for ")
# Mangled prefixes of libstdc++'s namespaces (std::, __gnu_cxx::), with the typeinfo, vtable,
# guard and local-static forms.
STD_PREFIXES = tuple(p + ns for p in ("_ZN", "_ZNK", "_ZTI", "_ZTS", "_ZTV", "_ZZN", "_ZZNK", "_ZGVZN", "_ZGVN")
                     for ns in ("St", "9__gnu_cxx")) + ("_ZSt", "_ZZSt", "_ZGVZSt")
WEAK_OR_UNIQUE = set("WwVvu")
# Leaks the self-test adds, one at a time: each must fail the check.
LEAKS = [
    ("T", "_ZN4grpc7Channel12CreateCallOpEv"),                 # grpc::Channel::CreateCallOp()
    ("T", "_ZN6google8protobuf7Message8CopyFromERKS1_"),       # google::protobuf::Message::CopyFrom
    ("T", "_ZN4ckpt2v115RegisterRequestC1Ev"),                 # the ckpt.v1 messages
    ("T", "_ZN4ckpt6Client4Impl8DrainGpuEv"),                  # Client's private nested type
    ("T", "_ZN4ckpt12ReleaseWords6CreateEv"),                  # an internal class
    ("W", "_ZN4ckpt13ShardRegistry4FindEv"),                   # an internal class, weak
    ("T", "cudaMalloc"),                                       # the CUDA runtime
    ("T", "XXH3_64bits"),                                      # xxhash
    ("T", "_ZNSt6vectorIiSaIiEE9push_backEOi"),                # std:: code that is not weak
]


def public_names(headers):
    """(classes marked CKPT_API, namespace-scope functions, private nested types per class)."""
    classes, functions, nested = set(), set(), {}
    for path in headers:
        text = open(path).read()
        for m in re.finditer(r"^(?:class|struct)\s+CKPT_API\s+(\w+)[^;]*?\{(.*?)^\};", text, re.M | re.S):
            classes.add(m.group(1))
            nested[m.group(1)] = set(re.findall(r"^\s+(?:class|struct)\s+(\w+)\s*;", m.group(2), re.M))
        # A declaration at column 0 ending in ");": a function of the namespace.
        functions.update(re.findall(r"^[A-Za-z_][\w:<>*& ]*?[\s*&](\w+)\([^;{]*\)\s*;", text, re.M))
    return classes, functions, nested


def read_symbols(library):
    """[(nm type letter, mangled name)] of the defined dynamic symbols."""
    out = subprocess.run(["nm", "-D", "--defined-only", "--format=posix", library], check=True,
                         capture_output=True, text=True).stdout
    symbols = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            symbols.append((parts[1], parts[0]))
    return symbols


def demangle(names):
    if not names:
        return []
    out = subprocess.run(["c++filt"], input="\n".join(names) + "\n", check=True, capture_output=True,
                         text=True).stdout
    return out.splitlines()


def leaks(symbols, classes, functions, nested):
    """The symbols that are not the public API, as (type, demangled) pairs."""
    bad = []
    for (kind, mangled), name in zip(symbols, demangle([m for _, m in symbols])):
        if mangled.startswith(STD_PREFIXES):
            if kind not in WEAK_OR_UNIQUE:
                bad.append((kind, name))
            continue
        bare = name
        for prefix in SPECIAL:
            if bare.startswith(prefix):
                bare = bare[len(prefix):]
                break
        ok = any(bare.startswith(f"ckpt::{f}(") for f in functions)
        for c in classes:
            if bare == f"ckpt::{c}" or bare.startswith(f"ckpt::{c}::"):
                ok = not any(bare.startswith(f"ckpt::{c}::{n}::") or bare == f"ckpt::{c}::{n}"
                             for n in nested.get(c, ()))
                break
        if not ok:
            bad.append((kind, name))
    return bad


def check(library, symbols, classes, functions, nested, quiet=False):
    """Prints what is wrong; returns True when nothing is."""
    problems = []
    names = demangle([m for _, m in symbols])
    for req in REQUIRED:
        if not any(n.startswith(req) for n in names):
            problems.append(f"missing from the exports: {req}")
    for kind, name in leaks(symbols, classes, functions, nested):
        problems.append(f"exported but not public API: {kind} {name}")
    if not quiet:
        for p in problems:
            print(f"{library}: {p}")
    return not problems


def check_soname(library):
    dyn = subprocess.run(["readelf", "-d", library], check=True, capture_output=True, text=True).stdout
    m = re.search(r"Library soname: \[(.*?)\]", dyn)
    real = os.path.basename(os.path.realpath(library))
    problems = []
    if not m or not re.fullmatch(r"libckpt\.so\.\d+", m.group(1)):
        problems.append(f"SONAME is {m.group(1) if m else 'missing'}, expected libckpt.so.MAJOR")
    if not re.fullmatch(r"libckpt\.so\.\d+\.\d+\.\d+", real):
        problems.append(f"the library file is {real}, expected libckpt.so.MAJOR.MINOR.PATCH")
    for p in problems:
        print(f"{library}: {p}")
    return not problems


def main(argv):
    self_test = argv[:1] == ["--self-test"]
    if self_test:
        argv = argv[1:]
    if len(argv) < 2:
        sys.exit(__doc__)
    library, headers = argv[0], argv[1:]
    classes, functions, nested = public_names(headers)
    if not classes or not functions:
        sys.exit(f"no CKPT_API class or public function found in {headers}")
    symbols = read_symbols(library)
    ok = check_soname(library) & check(library, symbols, classes, functions, nested)
    if not self_test:
        for (kind, _), name in zip(symbols, demangle([m for _, m in symbols])):
            print(f"  {kind} {name}")
        print(f"{library}: {len(symbols)} exported symbols: the public API ({', '.join(sorted(classes | functions))}) and weak libstdc++ instantiations"
              if ok else f"{library}: FAILED")
        return 0 if ok else 1
    if not ok:
        print("self-test: the check must pass on the library itself")
        return 1
    missed = [leak for leak in LEAKS if check(library, symbols + [leak], classes, functions, nested, quiet=True)]
    for kind, mangled in missed:
        print(f"self-test: a leak of {kind} {demangle([mangled])[0]} was not caught")
    if not missed:
        print(f"self-test: each of {len(LEAKS)} added leaks fails the check")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Checks that every #include goes down the layers of the code, never up or sideways.

The layers and what each may use are declared once, in LAYERS below (a component may use
the ones it names and, through them, everything they may use). A file's component is the
longest matching prefix of its path. An include of a file in a component that is not
reachable downwards fails the check, naming the file, the line and the rule it breaks.
Includes are written from the repository root ("format/paths.h"), so the compiler cannot
tell a layer from another; this script is what enforces them, in the build (the
check_layers target of CMakeLists.txt) and in CI.

  python3 scripts/check_layers.py            # check; exit 1 on an upward include
  python3 scripts/check_layers.py --diagram  # print the layer diagram of the README
  python3 scripts/check_layers.py --root DIR # check another checkout (the script's test)
"""
import os
import re
import subprocess
import sys

# component: (path prefixes, components it may include). Order: bottom to top.
LAYERS = {
    "common": (["common/"], []),
    "types": (["types/"], []),
    "format": (["format/"], ["common", "types"]),
    "proto": (["proto/"], ["common", "types"]),
    "backend": (["backend/"], ["common"]),
    "shm": (["shm/"], ["format"]),
    "cuda": (["cuda/"], ["backend"]),
    "daemon/base": (["daemon/base/"], ["format"]),
    "daemon/io": (["daemon/io/"], ["daemon/base", "shm", "backend"]),
    "daemon/metrics": (["daemon/metrics/"], ["daemon/base"]),
    "daemon/catalog": (["daemon/catalog/"], ["daemon/io"]),
    "daemon/tiers": (["daemon/tiers/"], ["daemon/catalog", "daemon/metrics"]),
    "daemon/pipeline": (["daemon/pipeline/"], ["daemon/tiers"]),
    "daemon/commit": (["daemon/commit/"], ["daemon/pipeline"]),
    "daemon/replication": (["daemon/replication/"], ["daemon/pipeline", "proto"]),
    "daemon/session": (["daemon/session/"], ["daemon/commit", "daemon/replication"]),
    "daemon": (["daemon/daemon."], ["daemon/session"]),
    "daemon/exposition": (["daemon/exposition/"], ["daemon"]),
    "daemon/rpc": (["daemon/rpc/"], ["daemon/exposition"]),
    "ckptd": (["daemon/main.cc"], ["daemon/rpc", "cuda"]),
    "client": (["client/"], ["cuda", "shm", "proto"]),
    "tools": (["tools/"], ["proto", "format"]),
    "python": (["python/"], ["client"]),
}
# Code above every layer, free to include any: tests, benchmarks, examples.
UNCHECKED = ["tests/", "bench/", "examples/", "cuda/tests/", "python/tests/"]
SOURCE_EXT = (".h", ".cc", ".cu", ".cpp")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def component(path):
    best = None
    for name, (prefixes, _) in LAYERS.items():
        for p in prefixes:
            if path.startswith(p) and (best is None or len(p) > best[1]):
                best = (name, len(p))
    return best[0] if best else None


def reachable(name, memo={}):
    if name not in memo:
        out = set()
        for dep in LAYERS[name][1]:
            out.add(dep)
            out |= reachable(dep)
        memo[name] = out
    return memo[name]


def resolve(include, including_file, files):
    """The repository path an include names: root-relative, then types/include, then the
    including file's directory; None for a generated or external header."""
    for candidate in (include, "types/include/" + include, "client/include/" + include,
                      os.path.normpath(os.path.join(os.path.dirname(including_file), include))):
        if candidate in files:
            return candidate
    return None


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if "--root" in sys.argv:
        root = sys.argv[sys.argv.index("--root") + 1]
    os.chdir(root)
    if "--diagram" in sys.argv:
        for name, (prefixes, deps) in LAYERS.items():
            print(f"{name:20} {' '.join(prefixes):24} -> {', '.join(deps) if deps else '(nothing)'}")
        return 0
    files = set(subprocess.check_output(["git", "ls-files", "-co", "--exclude-standard"], text=True).split("\n"))
    for name, (_, deps) in LAYERS.items():
        for dep in deps:
            if dep not in LAYERS:
                print(f"check_layers: {name} names an unknown layer {dep}", file=sys.stderr)
                return 2
            if name in reachable(dep):
                print(f"check_layers: the layers {name} and {dep} use each other", file=sys.stderr)
                return 2
    errors = []
    unknown = []
    for f in sorted(files):
        if not f.endswith(SOURCE_EXT) or any(f.startswith(u) for u in UNCHECKED) or not os.path.isfile(f):
            continue
        src = component(f)
        if src is None:
            unknown.append(f)
            continue
        with open(f, errors="replace") as text:
            for lineno, line in enumerate(text, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                target = resolve(m.group(1), f, files)
                if target is None:
                    continue
                dst = component(target)
                if dst is None or dst == src or dst in reachable(src):
                    continue
                why = "up a layer" if src in reachable(dst) else "sideways, between layers that do not use each other"
                errors.append(f"{f}:{lineno}: includes {target} ({dst}) from {src}: {why}")
    for f in unknown:
        errors.append(f"{f}: in no layer of scripts/check_layers.py (add its directory to LAYERS)")
    for e in errors:
        print(e)
    if errors:
        print(f"check_layers: {len(errors)} include(s) break the layers (see LAYERS in {__file__})", file=sys.stderr)
        return 1
    print(f"check_layers: {sum(1 for f in files if f.endswith(SOURCE_EXT))} files, every include goes down the layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())

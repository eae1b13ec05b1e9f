#!/usr/bin/env python3
"""Reports code written twice in the production sources.

Two kinds of repeat are found, after each line is normalised (comments removed,
whitespace collapsed, blank lines dropped):
  - functions whose bodies are identical and at least 3 lines long;
  - runs of at least 8 identical lines (include and import lines do not count, and a
    run must hold at least 6 lines longer than a closing brace).
The files: tracked C++ sources of common/ format/ proto/ shm/ backend/ cuda/ client/
daemon/ tools/ python/src/ (tests/, bench/ and examples/ are not production code, nor is
any tests/ folder inside those), and python/ckpt/*.py.

Each repeat is printed with its file:line places and a count at the end. The exit
status is 0 (the report is for reading in CI output) unless --fail-over N is given and
there are more than N repeats. Runs from any directory; standard library only.
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CPP_DIRS = ("common/", "format/", "proto/", "shm/", "backend/", "cuda/", "client/",
            "daemon/", "tools/", "python/src/")
CPP_EXT = (".h", ".hh", ".hpp", ".cc", ".cpp")
RUN_MIN = 8          # identical lines that make a run
RUN_SUBSTANTIVE = 6  # of which at least this many are more than punctuation
FUNC_MIN = 3         # body lines that make a function worth comparing

CPP_NOT_FUNC = re.compile(
    r"^(?:\}?\s*(?:else|if|for|while|switch|do|catch|try|namespace|class|struct|union|enum)\b"
    r"|.*=\s*\[.*\]\s*\(|.*\]\s*\(.*\)\s*(?:mutable\s*)?(?:->.*)?\{$)")


def tracked():
    out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], check=True,
                         stdout=subprocess.PIPE).stdout.decode("utf-8", "replace")
    files = []
    for p in out.split("\0"):
        if not p:
            continue
        if p.endswith(CPP_EXT) and p.startswith(CPP_DIRS):
            parts = p.split("/")
            if "tests" in parts or "test" in parts or re.search(r"_test\.\w+$", p):
                continue
            files.append(p)
        elif re.match(r"^python/ckpt/[^/]+\.py$", p):
            files.append(p)
    return files


def strip_cpp(lines):
    """Yields each line with comments and the contents of string literals' escapes kept
    as they are but comments removed. Block comments may span lines."""
    in_block = False
    for line in lines:
        out = []
        i, n = 0, len(line)
        quote = None
        while i < n:
            c = line[i]
            if in_block:
                end = line.find("*/", i)
                if end < 0:
                    i = n
                else:
                    i = end + 2
                    in_block = False
                continue
            if quote:
                out.append(c)
                if c == "\\" and i + 1 < n:
                    out.append(line[i + 1])
                    i += 2
                    continue
                if c == quote:
                    quote = None
                i += 1
                continue
            if c in "\"'":
                # A digit separator (1'000) is not a quote.
                if c == "'" and i > 0 and line[i - 1].isalnum() and i + 1 < n \
                        and line[i + 1].isalnum():
                    out.append(c)
                    i += 1
                    continue
                quote = c
                out.append(c)
                i += 1
                continue
            if line.startswith("//", i):
                break
            if line.startswith("/*", i):
                in_block = True
                i += 2
                continue
            out.append(c)
            i += 1
        yield "".join(out)


def strip_py(lines):
    for line in lines:
        out = []
        quote = None
        i, n = 0, len(line)
        while i < n:
            c = line[i]
            if quote:
                out.append(c)
                if c == "\\" and i + 1 < n:
                    out.append(line[i + 1])
                    i += 2
                    continue
                if c == quote:
                    quote = None
                i += 1
                continue
            if c in "\"'":
                quote = c
            elif c == "#":
                break
            out.append(c)
            i += 1
        yield "".join(out)


class Source:
    """One file: its normalised lines and the original line number of each."""

    def __init__(self, path, text):
        self.path = path
        self.is_py = path.endswith(".py")
        raw = text.splitlines()
        stripped = list(strip_py(raw) if self.is_py else strip_cpp(raw))
        self.raw_stripped = stripped  # one per original line, comments removed
        self.norm = []    # normalised, non-blank lines
        self.lineno = []  # original line number of each
        for i, line in enumerate(stripped):
            s = " ".join(line.split())
            if s:
                self.norm.append(s)
                self.lineno.append(i + 1)


def counts_in_run(line, is_py):
    if is_py:
        return not (line.startswith("import ") or line.startswith("from "))
    return not line.startswith("#include")


def substantive(line):
    return len(line.strip("{}();, ")) > 0 and len(line) > 3


def find_runs(sources):
    """Maximal runs of RUN_MIN+ identical normalised lines at two or more places."""
    windows = {}
    for f, src in enumerate(sources):
        norm = src.norm
        ok = [counts_in_run(l, src.is_py) for l in norm]
        for i in range(len(norm) - RUN_MIN + 1):
            if not all(ok[i:i + RUN_MIN]):
                continue
            win = norm[i:i + RUN_MIN]
            if sum(1 for l in win if substantive(l)) < RUN_SUBSTANTIVE:
                continue
            key = hashlib.blake2b("\n".join(win).encode(), digest_size=12).digest()
            windows.setdefault(key, []).append((f, i))
    covered = set()
    runs = []
    for key, locs in windows.items():
        # Places in one file must not overlap one another.
        kept = []
        for f, i in sorted(locs):
            if kept and kept[-1][0] == f and i - kept[-1][1] < RUN_MIN:
                continue
            kept.append((f, i))
        if len(kept) < 2 or kept[0] in covered:
            continue
        length = RUN_MIN
        while True:
            nxt = set()
            done = False
            for f, i in kept:
                norm = sources[f].norm
                j = i + length
                if j >= len(norm) or not counts_in_run(norm[j], sources[f].is_py):
                    done = True
                    break
                nxt.add(norm[j])
            if done or len(nxt) != 1:
                break
            length += 1
        for f, i in kept:
            for k in range(length - RUN_MIN + 1):
                covered.add((f, i + k))
        runs.append((length, kept))
    return runs


def cpp_functions(src):
    """(start line index, body lines) of each brace-delimited function in a C++ file."""
    lines = src.raw_stripped
    out = []
    i = 0
    n = len(lines)
    while i < n:
        line = lines[i].strip()
        # A function header ends with '{' (or is followed by a line '{'), has a parameter
        # list, and is not a control statement, a type or a lambda.
        header = line
        open_line = i
        if line == "{" and i > 0:
            header = lines[i - 1].strip()
        elif not line.endswith("{"):
            i += 1
            continue
        if ")" not in header or CPP_NOT_FUNC.match(header) or header.startswith("#"):
            i += 1
            continue
        depth = 0
        body = []
        j = open_line
        closed = False
        while j < n:
            text = lines[j]
            depth += text.count("{") - text.count("}")
            if j > open_line:
                body.append(text)
            if depth <= 0:
                closed = True
                break
            j += 1
        if not closed:
            break
        body_norm = [" ".join(b.split()) for b in body[:-1]]
        last = " ".join(body[-1].split()) if body else ""
        if last not in ("}", "};"):
            body_norm.append(last)
        body_norm = [b for b in body_norm if b]
        out.append((open_line, j, body_norm))
        i = j + 1
    return out


def py_functions(src):
    lines = src.raw_stripped
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)(?:async\s+)?def\s", line)
        if not m:
            continue
        indent = len(m.group(1))
        body = []
        end = i
        started = False
        for k in range(i + 1, len(lines)):
            text = lines[k]
            if not text.strip():
                continue
            ind = len(text) - len(text.lstrip())
            if ind <= indent and started:
                break
            if ind <= indent and not started and not text.strip().startswith((")", "]")):
                break
            if ind > indent:
                started = True
            body.append(" ".join(text.split()))
            end = k
        out.append((i, end, body))
    return out


def find_functions(sources):
    groups = {}
    for f, src in enumerate(sources):
        funcs = py_functions(src) if src.is_py else cpp_functions(src)
        for start, end, body in funcs:
            if len(body) < FUNC_MIN:
                continue
            key = hashlib.blake2b("\n".join(body).encode(), digest_size=12).digest()
            groups.setdefault(key, []).append((f, start, end, len(body)))
    return [locs for locs in groups.values() if len(locs) >= 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fail-over", type=int, metavar="N", default=None,
                    help="exit 1 when more than N repeats are found")
    args = ap.parse_args()

    sources = []
    for path in tracked():
        try:
            with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as fh:
                sources.append(Source(path, fh.read()))
        except OSError as e:
            print("%s: cannot read (%s)" % (path, e), file=sys.stderr)
            return 1

    count = 0
    funcs = find_functions(sources)
    for locs in sorted(funcs, key=lambda l: (sources[l[0][0]].path, l[0][1])):
        count += 1
        print("repeat %d: function body of %d lines, %d places" % (count, locs[0][3],
                                                                  len(locs)))
        for f, start, end, _ in locs:
            print("  %s:%d-%d" % (sources[f].path, start + 1, end + 1))
    # A run inside bodies already reported as one function repeat is that repeat again.
    in_funcs = {}
    for locs in funcs:
        for f, start, end, _ in locs:
            in_funcs.setdefault(f, []).append((start + 1, end + 1))

    def inside_reported(length, locs):
        for f, i in locs:
            lo, hi = sources[f].lineno[i], sources[f].lineno[i + length - 1]
            if not any(a <= hi and lo <= b for a, b in in_funcs.get(f, [])):
                return False
        return True

    runs = [r for r in find_runs(sources) if not inside_reported(*r)]
    for length, locs in sorted(runs, key=lambda r: (sources[r[1][0][0]].path, r[1][0][1])):
        count += 1
        print("repeat %d: %d identical lines, %d places" % (count, length, len(locs)))
        for f, i in locs:
            src = sources[f]
            print("  %s:%d-%d" % (src.path, src.lineno[i], src.lineno[i + length - 1]))
    print("%d repeats (%d function bodies, %d runs of %d+ lines) in %d files"
          % (count, len(funcs), len(runs), RUN_MIN, len(sources)))
    if args.fail_over is not None and count > args.fail_over:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

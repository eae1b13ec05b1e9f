#!/usr/bin/env python3
"""Lists every link to a repository file that does not exist.

Two kinds of reference are checked, in the files git tracks:
  - markdown links `[text](target)` in *.md files, resolved against the file's own
    directory (a target starting with '/' against the repository root);
  - repository paths named in comments of source files (C++, Python, shell, CMake,
    proto), such as `docs/BENCHMARKS.md` or `bench/run.sh`, resolved against the root.
Web and mail links and pure anchors are skipped; `#anchor` suffixes are stripped.

Targets git ignores (outputs a script writes, such as bench/out/) are not files of
the repository and are skipped. Prints `file:line: missing target` for each dangling
reference and exits 1 if there
is any, 0 otherwise. Runs from any directory: the repository is the one holding this
script. Standard library only.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# [text](target) or [text](target "title"); images too. Reference-style links are rare
# here and not checked.
MD_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")

# Top-level directories whose files comments name. A path must end in a file extension
# so that prose such as "docs/ops" or "tests/ (every test)" is not taken for a file.
PATH_DIRS = ("docs", "bench", "scripts", "tests", "deploy", "examples", "tools",
             "common", "format", "proto", "shm", "backend", "cuda", "client", "daemon",
             "python", "types")
COMMENT_PATH = re.compile(
    r"(?<![\w./-])((?:%s)/[\w.+-]+(?:/[\w.+-]+)*\.[A-Za-z][\w]*)" % "|".join(PATH_DIRS))

SOURCE_EXT = (".h", ".hh", ".hpp", ".c", ".cc", ".cpp", ".cu", ".py", ".sh", ".proto",
              ".cmake", ".txt", ".toml", ".cfg", ".in")
# Comment introducers per kind of file.
SLASH_COMMENT = (".h", ".hh", ".hpp", ".c", ".cc", ".cpp", ".cu", ".proto")
HASH_COMMENT = (".py", ".sh", ".cmake", ".txt", ".toml", ".cfg", ".in")


def tracked_files():
    out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], check=True,
                         stdout=subprocess.PIPE).stdout
    return [p for p in out.decode("utf-8", "replace").split("\0") if p]


def exists(rel):
    return os.path.exists(os.path.join(ROOT, rel))


def check_markdown(path, text, missing):
    base = os.path.dirname(path)
    in_fence = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for m in MD_LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http:, https:, mailto:, ... or an anchor in this file
            target = target.split("#", 1)[0].split("?", 1)[0]
            if not target:
                continue
            if target.startswith("/"):
                rel = os.path.normpath(target.lstrip("/"))
            else:
                rel = os.path.normpath(os.path.join(base, target))
            if rel.startswith("..") or not exists(rel):
                missing.append((path, lineno, target, rel))


def comment_parts(path, text):
    """Yields (line number, comment text) for each line that has a comment."""
    slash = path.endswith(SLASH_COMMENT)
    in_block = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if slash:
            parts = []
            rest = line
            while rest:
                if in_block:
                    end = rest.find("*/")
                    if end < 0:
                        parts.append(rest)
                        rest = ""
                    else:
                        parts.append(rest[:end])
                        rest = rest[end + 2:]
                        in_block = False
                    continue
                line_c = rest.find("//")
                block_c = rest.find("/*")
                if line_c < 0 and block_c < 0:
                    break
                if line_c >= 0 and (block_c < 0 or line_c < block_c):
                    parts.append(rest[line_c + 2:])
                    break
                rest = rest[block_c + 2:]
                in_block = True
            if parts:
                yield lineno, " ".join(parts)
        else:
            # '#' comments, and Python docstrings and strings: a path in either is a
            # reference a reader follows.
            if "#" in line or path.endswith(".py"):
                yield lineno, line


def check_source(path, text, missing):
    for lineno, comment in comment_parts(path, text):
        for m in COMMENT_PATH.finditer(comment):
            target = m.group(1).rstrip(".,;:")
            if "*" in target or "<" in target:
                continue
            if not exists(target):
                missing.append((path, lineno, target, target))


def drop_ignored(missing):
    """Drops targets git ignores: outputs a script writes (bench/out/, tests/gpu/out/)
    are named in its comments but are not repository files."""
    targets = sorted({rel for _, _, _, rel in missing if not rel.startswith("..")})
    if not targets:
        return missing
    out = subprocess.run(["git", "-C", ROOT, "check-ignore", "--no-index", "--stdin", "-z"],
                         input="\0".join(targets).encode() + b"\0",
                         stdout=subprocess.PIPE).stdout
    ignored = set(p for p in out.decode("utf-8", "replace").split("\0") if p)
    return [m for m in missing if m[3] not in ignored]


def main():
    missing = []
    for path in tracked_files():
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            continue
        is_md = path.endswith(".md")
        is_src = path.endswith(SOURCE_EXT) and "/fuzz/corpus/" not in path \
            and "/fuzz/regressions/" not in path and not path.startswith("docs/results/")
        if not (is_md or is_src):
            continue
        try:
            with open(full, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            print("%s:0: cannot read (%s)" % (path, e))
            return 1
        if is_md:
            check_markdown(path, text, missing)
        else:
            check_source(path, text, missing)
    missing = drop_ignored(missing)
    for path, lineno, target, _ in missing:
        print("%s:%d: missing %s" % (path, lineno, target))
    if missing:
        print("%d missing link target(s)" % len(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

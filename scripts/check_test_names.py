#!/usr/bin/env python3
"""Lists every Catch2 test case whose name ctest cannot register whole.

catch_discover_tests hands each test name to CMake as a list element, so a ';' in a name
splits it into two tests that both fail at once ("No test cases matched"), and the test
itself never runs under ctest. Reads the TEST_CASE names of tests/**/*.cc (adjacent string
literals joined), prints `file:line: name` for each name holding a ';', and exits 1 if
there is any, 0 otherwise. Standard library only; runs from any directory.
"""

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_CASE = re.compile(r'TEST_CASE\(\s*((?:"(?:[^"\\\n]|\\.)*"\s*)+)')
LITERAL = re.compile(r'"((?:[^"\\\n]|\\.)*)"')


def main():
    bad = 0
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "**", "*.cc"), recursive=True)):
        text = open(path, encoding="utf-8", errors="replace").read()
        for m in TEST_CASE.finditer(text):
            name = "".join(LITERAL.findall(m.group(1)))
            if ";" in name:
                line = text.count("\n", 0, m.start()) + 1
                print(f"{os.path.relpath(path, ROOT)}:{line}: a ';' splits this test's name under ctest: {name}")
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

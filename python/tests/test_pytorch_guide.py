"""Runs every example of docs/pytorch.md against a real ckptd, so the guide cannot drift.

Each ```python block whose first line is `# example: NAME` is a complete program. The blocks
run in the guide's order, each in a fresh interpreter, against one daemon (later examples
read what earlier ones saved, as a reader following the guide would see). Some examples
make claims that a run alone does not check (train.py resumes bit for bit); those are
checked here against the output.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "pytorch.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
RESHARDING = ["reshard.py", "zero_reshard.py", "private_refused.py"]  # section 7, in order
EXPECTED = ["train.py", "read_shard.py", "in_place.py", "fresh_or_resume.py", "durable.py", "big_state.py",
            *RESHARDING]


def examples():
    found = []
    for m in BLOCK.finditer(GUIDE.read_text()):
        code = m.group(1)
        first = code.splitlines()[0] if code else ""
        head = re.match(r"# example: (\S+)$", first)
        assert head, f"a python block of {GUIDE} does not start with '# example: NAME': {first!r}"
        found.append((head.group(1), code))
    return found


def run(path, env, cwd):
    proc = subprocess.run([sys.executable, str(path)], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def last_line(out):
    return out.strip().splitlines()[-1]


def test_guide_lists_its_examples():
    assert [name for name, _ in examples()] == EXPECTED


def test_guide_examples_run(daemon, temp_dir):
    try:
        import safetensors  # noqa: F401  (read_shard.py uses the real package)
    except ImportError:
        pytest.skip("the safetensors package is not installed (scripts/test.sh installs it into build/pydeps)")
    env = daemon.env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    code = dict(examples())
    for name, text in examples():
        path = Path(temp_dir) / name
        path.write_text(text)

    first = run(Path(temp_dir) / "train.py", env, temp_dir)
    assert "started fresh" in first, first
    second = run(Path(temp_dir) / "train.py", env, temp_dir)
    assert "resumed at step 5" in second, second
    # The guide's claim: two runs of 5 steps print what one uninterrupted run of 10 prints.
    ref = code["train.py"].replace('"guide-train"', '"guide-train-ref"').replace("range(5)", "range(10)")
    assert ref != code["train.py"]
    (Path(temp_dir) / "train_ref.py").write_text(ref)
    whole = run(Path(temp_dir) / "train_ref.py", env, temp_dir)
    assert last_line(second) == last_line(whole), (second, whole)
    assert last_line(second).startswith("step 10 "), second

    for name in EXPECTED[1:-len(RESHARDING)]:
        out = run(Path(temp_dir) / name, env, temp_dir)
        assert out.strip(), f"{name} printed nothing"


def test_guide_resharding_examples_run(daemon, temp_dir):
    env = daemon.env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    code = dict(examples())
    outputs = {}
    for name in RESHARDING:
        path = Path(temp_dir) / name
        path.write_text(code[name])
        outputs[name] = run(path, env, temp_dir)
    assert "2 ranks: each holds its rows" in outputs["reshard.py"]
    assert "3 ranks: each holds its rows" in outputs["reshard.py"]
    assert "refused:" in outputs["private_refused.py"]

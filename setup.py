"""`pip install .` from the repository root: the same as `pip install ./python` (see python/setup.py)."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "python" / "setup.py"), run_name="__main__")

"""pip install ./python (or `pip install .` from the repository root): builds the `ckpt` package.

The extension is built by the project's own CMake build (target _ckpt, tests off) for the
interpreter running pip, into build-pip/ beside the directory pip runs in; the wheel holds
ckpt/*.py, ckpt/_ckpt*.so and ckpt/libckpt.so.0 (the extension finds it through its RPATH,
$ORIGIN). Needs cmake, a C++20 compiler and the project's build dependencies
(scripts/install-deps.sh); pybind11 comes from PyPI (build requirement) or pybind11-dev.
The wheel links the system's gRPC/protobuf/xxhash: it is for this machine (or identical
ones), not for PyPI.

Environment: CKPT_CMAKE_ARGS (extra cmake arguments, e.g. "-DCKPT_WITH_CUDA=OFF"),
CMAKE_BUILD_PARALLEL_LEVEL (build jobs; default: the number of CPUs).
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent  # python/
SOURCE = HERE.parent                    # the CMake project (repository root)


def project_version():
    text = (SOURCE / "CMakeLists.txt").read_text()
    m = re.search(r"project\(ckptd\s+VERSION\s+([0-9.]+)", text)
    return m.group(1) if m else "0.0.0"


class BuildWithCMake(build_py):
    """build_py plus the CMake build of the extension and libckpt, copied into the package."""

    def run(self):
        super().run()
        cmake = shutil.which("cmake")
        if not cmake:
            sys.exit("ckpt: building the extension needs cmake (scripts/install-deps.sh installs it)")
        build_dir = Path(self.get_finalized_command("build").build_temp).resolve() / "cmake"
        args = [cmake, "-S", str(SOURCE), "-B", str(build_dir),
                "-DCMAKE_BUILD_TYPE=Release", "-DCKPT_BUILD_TESTS=OFF", "-DCKPT_BUILD_PYTHON=ON",
                f"-DPython3_EXECUTABLE={sys.executable}",
                # The RPATH the files get in the wheel ($ORIGIN), not the build tree's.
                "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"]
        try:
            import pybind11
            args.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
        except ImportError:
            pass  # pybind11-dev's config, found by CMake itself
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        args += shlex.split(os.environ.get("CKPT_CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        if build_dir.exists() and (build_dir / "CMakeCache.txt").exists():
            # A generator change between runs would make cmake refuse the cache.
            cached = (build_dir / "CMakeCache.txt").read_text()
            if ("-G" in args) != ("CMAKE_GENERATOR:INTERNAL=Ninja" in cached):
                shutil.rmtree(build_dir)
        subprocess.check_call(args)
        subprocess.check_call([cmake, "--build", str(build_dir), "--target", "_ckpt", "-j", jobs])

        package = Path(self.build_lib) / "ckpt"
        package.mkdir(parents=True, exist_ok=True)
        built = list((build_dir / "python" / "ckpt").glob("_ckpt*.so"))
        if len(built) != 1:
            sys.exit(f"ckpt: expected one _ckpt*.so in {build_dir / 'python' / 'ckpt'}, found {built}")
        shutil.copy2(built[0], package / built[0].name)
        # The extension needs libckpt by its SONAME; copy the real file under that name.
        shutil.copy2((build_dir / "libckpt.so.0").resolve(), package / "libckpt.so.0")


class BinaryDistribution(Distribution):
    """The wheel holds a compiled extension: tag it for this interpreter and platform."""

    def has_ext_modules(self):
        return True


setup(
    name="ckptd",
    version=project_version(),
    description="Python client of ckptd, the node-local checkpoint daemon, and a reader of its shards",
    python_requires=">=3.8",
    packages=["ckpt"],
    package_dir={"ckpt": os.path.relpath(HERE / "ckpt", os.getcwd())},
    cmdclass={"build_py": BuildWithCMake},
    distclass=BinaryDistribution,
    options={"build": {"build_base": "build-pip"}},
    zip_safe=False,
)

"""pip install ./python (or `pip install .` from the repository root): builds the `ckpt` package.

The extension is built by the project's own CMake build (target _ckpt, tests off) for the
interpreter running pip, into build-pip/ beside the directory pip runs in; the wheel holds
ckpt/*.py, ckpt/_ckpt*.so and ckpt/libckpt.so.0 (the extension finds it through its RPATH,
$ORIGIN). Needs cmake, a C++20 compiler and the project's build dependencies
(scripts/install-deps.sh); pybind11 comes from PyPI (build requirement) or pybind11-dev.
The wheel links the system's gRPC/protobuf/xxhash: it is for this machine (or identical
ones), not for PyPI.

Environment: CKPT_CMAKE_ARGS (extra cmake arguments, e.g. "-DCKPT_WITH_CUDA=OFF"),
CMAKE_BUILD_PARALLEL_LEVEL (build jobs; default: the number of CPUs), CKPT_BUILD_DIR (an
existing build tree of the project, configured for an interpreter of the same ABI: its
extension and libckpt are taken, brought up to date first, instead of a build of its own;
`pip wheel --no-build-isolation ./python` with it takes seconds).

Either way the extension is taken from `cmake --install --component python`, which gives it
its installed RPATH ($ORIGIN), and the version of the package is the C++ project's.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
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

    def configure_cmake(self, cmake, build_dir):
        args = [cmake, "-S", str(SOURCE), "-B", str(build_dir),
                "-DCMAKE_BUILD_TYPE=Release", "-DCKPT_BUILD_TESTS=OFF", "-DCKPT_BUILD_PYTHON=ON",
                f"-DPython3_EXECUTABLE={sys.executable}"]
        try:
            import pybind11
            args.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
        except ImportError:
            pass  # pybind11-dev's config, found by CMake itself
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        args += shlex.split(os.environ.get("CKPT_CMAKE_ARGS", ""))
        if build_dir.exists() and (build_dir / "CMakeCache.txt").exists():
            # A generator change between runs would make cmake refuse the cache.
            cached = (build_dir / "CMakeCache.txt").read_text()
            if ("-G" in args) != ("CMAKE_GENERATOR:INTERNAL=Ninja" in cached):
                shutil.rmtree(build_dir)
        subprocess.check_call(args)

    def run(self):
        super().run()
        cmake = shutil.which("cmake")
        if not cmake:
            sys.exit("ckpt: building the extension needs cmake (scripts/install-deps.sh installs it)")
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        if os.environ.get("CKPT_BUILD_DIR"):
            build_dir = Path(os.environ["CKPT_BUILD_DIR"]).resolve()
            if not (build_dir / "CMakeCache.txt").exists():
                sys.exit(f"ckpt: CKPT_BUILD_DIR={build_dir} is not a configured build tree")
        else:
            build_dir = Path(self.get_finalized_command("build").build_temp).resolve() / "cmake"
            self.configure_cmake(cmake, build_dir)
        subprocess.check_call([cmake, "--build", str(build_dir), "--target", "_ckpt", "-j", jobs])
        stage = Path(self.get_finalized_command("build").build_temp).resolve() / "stage"
        shutil.rmtree(stage, ignore_errors=True)
        subprocess.check_call([cmake, "--install", str(build_dir), "--component", "python", "--prefix", str(stage)])

        package = Path(self.build_lib) / "ckpt"
        package.mkdir(parents=True, exist_ok=True)
        built = list((stage / "ckpt").glob("_ckpt*.so"))
        if len(built) != 1:
            sys.exit(f"ckpt: expected one _ckpt*.so in {stage / 'ckpt'}, found {built}")
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        if not built[0].name.endswith(suffix):
            sys.exit(f"ckpt: {built[0].name} in {build_dir} is not built for this interpreter ({suffix}); "
                     f"configure it with -DPython3_EXECUTABLE={sys.executable}")
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

"""Builds the Go shared library with `go build -buildmode=c-shared` and ships it
inside the package (python/kvbm/lib/libkvbm.so).

The wheel is a platform wheel tagged py3-none-<platform>: the library is loaded
with ctypes and does not link libpython, so one wheel serves every CPython the
package supports. `make wheel` retags it manylinux with auditwheel."""

import os
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def build_native():
    if os.environ.get("KVBM_SKIP_GO_BUILD"):
        return
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("building kvbm needs Go (https://go.dev/dl/) on PATH")
    out = os.path.join(ROOT, "python", "kvbm", "lib", "libkvbm.so")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    env = dict(os.environ, CGO_ENABLED="1")
    subprocess.check_call([go, "build", "-trimpath", "-buildmode=c-shared",
                           "-ldflags=-extldflags=-Wl,--version-script=" + os.path.join(ROOT, "capi", "exports.map"),
                           "-o", out, "./capi"], cwd=ROOT, env=env)
    header = out[:-3] + ".h"
    if os.path.exists(header):
        os.remove(header)


class BuildPyWithGo(build_py):
    def run(self):
        build_native()
        super().run()


class PlatformWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithGo, "bdist_wheel": PlatformWheel}, distclass=BinaryDistribution)

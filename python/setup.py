"""Build the _tdpipe extension against a built or installed libtdpipe.

Where libtdpipe is found, first match wins:
  1. TDPIPE_PREFIX=/some/prefix      an install: PREFIX/include, PREFIX/lib*
  2. TDPIPE_BUILD_DIR=/path/build    a CMake build tree of this repository
                                     (headers from the repository's include/)
  3. pkg-config tdpipe               an install on PKG_CONFIG_PATH
  4. ../build                        the repository's own build/ (the default
                                     of scripts/demo.sh and scripts/test.sh)
The library directory is written into the module's RPATH, so `import tdpipe`
needs no LD_LIBRARY_PATH.
"""
import os
import shlex
import subprocess

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _from_prefix(prefix):
    libdirs = [os.path.join(prefix, d) for d in ("lib", "lib64", "lib/x86_64-linux-gnu")
               if os.path.isdir(os.path.join(prefix, d))]
    return [os.path.join(prefix, "include")], libdirs


def _from_pkg_config():
    try:
        cflags = subprocess.run(["pkg-config", "--cflags-only-I", "tdpipe"], check=True,
                                capture_output=True, text=True).stdout
        libs = subprocess.run(["pkg-config", "--libs-only-L", "tdpipe"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    inc = [f[2:] for f in shlex.split(cflags) if f.startswith("-I")]
    lib = [f[2:] for f in shlex.split(libs) if f.startswith("-L")]
    return inc, lib


def find_tdpipe():
    if os.environ.get("TDPIPE_PREFIX"):
        return _from_prefix(os.environ["TDPIPE_PREFIX"])
    build = os.environ.get("TDPIPE_BUILD_DIR")
    if build:
        return [os.path.join(REPO, "include")], [os.path.abspath(build)]
    found = _from_pkg_config()
    if found is not None:
        return found
    build = os.path.join(REPO, "build")
    if os.path.exists(os.path.join(build, "libtdpipe.so")):
        return [os.path.join(REPO, "include")], [build]
    raise SystemExit("libtdpipe not found: build the repository (cmake -S . -B build && "
                     "cmake --build build), or set TDPIPE_PREFIX or TDPIPE_BUILD_DIR")


inc, libdirs = find_tdpipe()
setup(ext_modules=[Extension(
    "tdpipe._tdpipe",
    sources=["src/_tdpipe.c"],
    include_dirs=inc,
    library_dirs=libdirs,
    runtime_library_dirs=libdirs,
    libraries=["tdpipe"],
    extra_compile_args=["-std=gnu11", "-Wno-missing-field-initializers"],
)])

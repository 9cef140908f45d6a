"""The hot path compiled: the modules nptrace/compiled.py lists, compiled by Cython from their
own .py sources (no second implementation) into extension modules beside them.

pyproject.toml holds the project's metadata; setuptools reads the extensions from here (its
pyproject table for them is newer than Debian 12's setuptools, which the image builds with).
`optional=True`, and no extensions without Cython or with NPTRACE_COMPILE=0: without it, a C compiler or Python's
headers the install still succeeds and nptrace runs the same modules as Python (`nptrace
doctor`'s `hot path` row says which)."""
import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# nptrace/compiled.py imports nothing of nptrace: loaded by path, not as the package
_spec = importlib.util.spec_from_file_location("_nptrace_compiled", "nptrace/compiled.py")
compiled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled)

try:
    from Cython.Build import cythonize
    if os.environ.get("NPTRACE_COMPILE") == "0":     # scripts/setup.sh's host profile
        raise ImportError
except ImportError:
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension(m, [m.replace(".", "/") + ".py"], optional=True,
                   extra_compile_args=["-O2", "-Wno-unused-function"]) for m in compiled.MODULES],
        # annotations are documentation here, not C types: the modules must behave exactly as
        # they do uncompiled (an `x: list` argument given a tuple still works)
        compiler_directives={"language_level": 3, "annotation_typing": False,
                             "binding": True, "embedsignature": False},
        # the generated C goes under build/, not beside the sources: nptrace/ holds no C
        build_dir="build/cython", quiet=True, nthreads=os.cpu_count() or 1)


class ParallelBuildExt(build_ext):
    """The extensions compiled side by side, one per CPU (the build is most of `make setup`)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1


setup(ext_modules=ext_modules, cmdclass={"build_ext": ParallelBuildExt})

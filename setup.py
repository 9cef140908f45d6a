"""The compiled helpers of the hot path (issue #16 item 3): optional C extensions.

pyproject.toml holds the project's metadata; setuptools reads the extensions from here (its
pyproject table for them is newer than Debian 12's setuptools, which the image builds with).
`optional=True`: without a C compiler or Python's headers the install still succeeds and
nptrace runs its pure-Python paths (events.NATIVE, jsonl.NATIVE say which; `nptrace doctor`
reports it)."""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("nptrace.events_fast", ["nptrace/events_fast.c"], optional=True,
              extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"]),
    Extension("nptrace.classify.correlate_fast",
              ["nptrace/classify/correlate_fast.c", "nptrace/classify/feed_fast.c"],
              depends=["nptrace/classify/correlate_fast.h", "nptrace/slots.h"],
              optional=True,
              extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"]),
    Extension("nptrace.sinks.jsonl_fast",
              ["nptrace/sinks/jsonl_fast.c", "nptrace/sinks/jsonl_multi.c",
               "nptrace/sinks/jsonl_seconds.c"],
              depends=["nptrace/sinks/jsonl_fast.h", "nptrace/slots.h"], optional=True,
              extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"]),
])

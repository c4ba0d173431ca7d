"""Build hook for the one optional C extension (everything else lives in pyproject.toml).

``tieredkv.transfer.backends._rowcopy`` makes the CPU copy path ~1.3x faster (streaming stores, no GIL).
It is optional: where no C compiler is available the install still succeeds and tieredkv uses
its numpy copy path, saying so in its start-up log line.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tieredkv.transfer.backends._rowcopy",
            sources=["tieredkv/transfer/backends/_rowcopy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)

"""The optional native transpose kernel (ckptconv/io/_transpose.c); everything else is in pyproject.toml.

``optional=True``: without a C compiler the build skips it and ckptconv transposes with torch (ckptconv.io.transpose).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptconv.io._transpose", ["ckptconv/io/_transpose.c"], optional=True,
                             extra_compile_args=["-O3"])])

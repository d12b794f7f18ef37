"""The one thing pyproject.toml cannot say stably: the optional C module (mta/dkim/_canon.c says why it exists).

``optional=True``: where it cannot be built (no C compiler, no Python headers) the install goes on and
``mta.dkim.canon`` uses its Python twins, which give the same bytes.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("mta.dkim._canon", ["mta/dkim/_canon.c"], optional=True)])

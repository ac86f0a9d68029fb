# The package's one version: pyproject.toml reads it (setuptools' attr) and tune()'s cache
# keys on it (tuning.environment); a module of its own, so neither needs the package imported.
__version__ = "0.1.0"

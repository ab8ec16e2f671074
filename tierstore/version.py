"""The package version, in a module of its own so that nothing has to import ``tierstore``
(the package, which imports the whole store) just to read it."""

__version__ = "0.1.0"

"""funduq-trio: a broker between AI agent providers and their callers, on trio."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("funduq-trio")
except PackageNotFoundError:  # running from a tree that was never installed
    __version__ = "0+unknown"

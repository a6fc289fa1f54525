"""The Python client of an eyas service (`Client`), batch jobs, and the `eyas` command line."""

from .client import Client, EyasError

__all__ = ["Client", "EyasError"]

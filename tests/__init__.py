"""eyas's tests; a package so that `tests.helpers` imports without touching sys.path."""

"""Benchmarks of hsdispatch (``hsd bench ...``): measurement tools, kept out of the daemon's package."""

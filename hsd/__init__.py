"""The ``hsd`` command line, the top layer: each subcommand parses its arguments and calls into the
layers below (the benchmarks, the operator's tools, the daemon and the workers); nothing imports it."""

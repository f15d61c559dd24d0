"""The ``offload`` command line (see :mod:`offload.cli.main`)."""

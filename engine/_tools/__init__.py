"""Tools built on the engine: the ``evenflow`` command, the demo and the benchmarks.

The core never imports this wing.
"""

"""``evenflow bench <name>``: one module per benchmark, each with ``main(argv, prog)``."""

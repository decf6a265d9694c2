"""Distributed set-up: rank and mesh arithmetic, ``build_loader``, the model-parallel loader."""

"""Step sources: from a dataset (or a stream of samples) to the steps ``BalancedLoader`` reads.

A *step source* is what ``BalancedLoader(source, ...)`` consumes: an iterable that yields one
local step at a time, a step being ``bins_per_rank`` non-empty bins of raw samples, with
``set_epoch``, ``state_dict``/``load_state_dict`` and (where it can be known) ``len()``.

``packing`` packs sample lengths into steps (first-fit over the stream, best-fit-decreasing
over a bounded buffer); ``_lengths`` reads and checks the lengths of a map-style dataset once,
vectorised; ``dataset`` is the map-style source (a seeded per-epoch permutation, dealt to ranks
without communication); ``iterable`` wraps generator factories, Hugging Face iterable datasets,
``torchdata`` nodes and ``StatefulDataLoader``; ``_common`` holds what both sources share (the
matching ``metadata_fn``, the oversized-sample policies, the report of what an epoch drops).
"""

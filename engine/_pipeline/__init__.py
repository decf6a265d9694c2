"""The pipeline: source reading, metadata gather, planning, exchange, pack, host-to-device.

``loader`` is the user-facing ``BalancedLoader``, built from ``parts`` (validated arguments,
planner, identity) and ``binding`` (its source and transports), with its threads in
``loader_threads`` and its position and checkpoint in ``position``, on the lifecycle of
``facade`` (sync and async entry points written once, over ``loop_thread``); ``pipeline`` wires
the stages over bounded channels, one module each (``read_stage`` over ``source``, ``gather``,
``plan_stage``, ``exchange`` or ``read_assigned``, ``pack_stage``, ``world_round``,
``h2d_stage``), sharing ``progress``; ``step`` is the state one step carries through them, with
``records`` for what a feature adds; ``sequencer`` orders collectives; ``launchpoints`` queues
device launches for the caller's thread; ``pack`` and ``h2d`` turn samples into device batches,
and ``pack_check`` holds each packed bin to the metadata it was planned from; ``resume`` and
``stats`` are the loader's state and statistics; ``calibration`` carries measured compute
through the metadata round to a calibrated cost model. The loader's threads are
``transports.internal.WorkerThreads``: daemon threads with a bounded shutdown, through which
nothing user code raises can stop an event loop.
"""

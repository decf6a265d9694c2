"""Planning: from a gathered step to a new layout of its samples.

The planner (``planner``) validates a step, prices its samples with a cost model (``cost``,
``flops``, ``vision``; ``calibration``: a model refitted to measured compute), runs a
balancing algorithm (``registry``; ``problem``: the contract; ``lpt``: the reference greedy;
``refine`` and ``search``: the default local search, whose starts, phases, budgets and tuning
constants are data in ``schedule``) against an objective (``objectives``) and gates the result
against the source layout. The greedy, the search's one driver and its move families, the
settle and a bound run in the compiled core, reached only through ``native``. Nothing here
touches a transport or the event loop.
"""

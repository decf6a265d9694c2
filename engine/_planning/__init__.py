"""Planning: from a gathered step to a new layout of its samples.

The planner (``planner``) validates a step, prices its samples with a cost model (``cost``,
``flops``), runs a balancing algorithm (``algorithms``: the contract and the reference greedy;
``refine``: the default local search) against an objective (``objectives``) and gates the result
against the source layout. Nothing here touches a transport or the event loop.
"""

"""``evenflow demo``: the driver (``run``), its tiny model (``model``), its report (``report``)."""

"""evenflow.engine.planning — the face for cost-model and balancing-algorithm authors.

A loop needs none of this: ``LoaderConfig(cost_model="tokens")`` and the default algorithm
serve most runs. Come here to price samples differently (a :class:`CostModel`, the built-in
models, a :class:`CalibratedCost` refitted to measured compute), to plug in a
:class:`BalancingAlgorithm`, or to drive a :class:`Planner` directly. The sample description
both audiences share, :class:`~evenflow.engine.SampleMetadata`, lives in ``evenflow.engine``.

Names are declared once each, as in ``evenflow.engine`` (see ``transports/_face.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from evenflow.transports.internal import serve as _serve

if TYPE_CHECKING:
    # Cost models: what a sample costs to train on.
    from evenflow.engine._planning.calibration import CalibratedCost as CalibratedCost
    from evenflow.engine._planning.cost import ComponentCost as ComponentCost
    from evenflow.engine._planning.cost import CostModel as CostModel
    from evenflow.engine._planning.cost import QuadraticCost as QuadraticCost
    from evenflow.engine._planning.cost import TokenCost as TokenCost
    from evenflow.engine._planning.flops import FlopsCost as FlopsCost
    from evenflow.engine._planning.vision import VisionLanguageCost as VisionLanguageCost

    # isort: split
    # Balancing: the problem an algorithm solves, the built-in algorithms, the planner.
    from evenflow.engine._model import PackingConstraints as PackingConstraints
    from evenflow.engine._model import SampleKey as SampleKey
    from evenflow.engine._plan import BinPlan as BinPlan
    from evenflow.engine._plan import Plan as Plan
    from evenflow.engine._planning.lpt import LPTAlgorithm as LPTAlgorithm
    from evenflow.engine._planning.planner import Planner as Planner
    from evenflow.engine._planning.problem import BalanceProblem as BalanceProblem
    from evenflow.engine._planning.problem import BalancingAlgorithm as BalancingAlgorithm
    from evenflow.engine._planning.problem import FlatLayout as FlatLayout
    from evenflow.engine._planning.refine import RefineAlgorithm as RefineAlgorithm

_serve(__name__)

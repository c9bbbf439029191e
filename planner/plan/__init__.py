"""The plan file: what each stage computes (``stages``), where it runs (``layout``), and why.

Standard library only, so the runtime and `tessera show` read plans cheaply.
"""

from planner.plan.codec import freeze
from planner.plan.document import Plan
from planner.plan.invariants import check_invariants
from planner.plan.kinds import ScheduleKind
from planner.plan.layout import Layout, RankPlace
from planner.plan.parts import (
                                ClusterSpec,
                                InputMeta,
                                LayerRow,
                                ModelRef,
                                OffloadSpec,
                                ParamTier,
                                Prediction,
                                RunnerUp,
                                ScheduleSpec,
                                SolverReport,
                                StagePlan,
                                StagePrediction,
                                StateTier,
                                TiedSum,
                                TrainingSpec,
                                Transfer,
)
from planner.plan.spatial import HaloMode, Slicing, SpatialSpec
from planner.plan.upgrade import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "ClusterSpec", "HaloMode", "InputMeta", "LayerRow", "Layout", "ModelRef",
           "OffloadSpec", "ParamTier", "Plan", "Prediction", "RankPlace", "RunnerUp", "ScheduleKind",
           "ScheduleSpec", "Slicing", "SolverReport", "SpatialSpec", "StagePlan", "StagePrediction", "StateTier",
           "TiedSum", "TrainingSpec", "Transfer", "check_invariants", "freeze"]

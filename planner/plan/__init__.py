"""The plan file: what a stage computes, where it runs (the layout), and how it was chosen.

Standard library only, so the runtime and `tessera show` read plans cheaply.
"""

from planner.plan.document import (SCHEMA_VERSION, ClusterSpec, InputMeta, LayerRow, ModelRef,
                                   OffloadSpec, Plan, Prediction, ScheduleKind, ScheduleSpec,
                                   SolverReport, StagePlan, StagePrediction, TrainingSpec, Transfer,
                                   freeze)

__all__ = ["SCHEMA_VERSION", "ClusterSpec", "InputMeta", "LayerRow", "ModelRef", "OffloadSpec", "Plan",
           "Prediction", "ScheduleKind", "ScheduleSpec", "SolverReport", "StagePlan", "StagePrediction",
           "TrainingSpec", "Transfer", "freeze"]

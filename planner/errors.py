"""tessera's error hierarchy, re-exported from cost_models.errors (its home, below every package)."""

from cost_models.errors import (
                                CheckpointError,
                                InvalidArgument,
                                ModelSpecError,
                                PeerFailure,
                                PlanFileError,
                                PlanInfeasible,
                                ProfileError,
                                RankFailure,
                                RuntimeSetupError,
                                SpatialError,
                                TesseraError,
                                TraceError,
                                UnknownDevice,
)

__all__ = ["CheckpointError", "InvalidArgument", "ModelSpecError", "PeerFailure", "PlanFileError",
           "PlanInfeasible", "ProfileError", "RankFailure", "RuntimeSetupError", "SpatialError",
           "TesseraError", "TraceError", "UnknownDevice"]

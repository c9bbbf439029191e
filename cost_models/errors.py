"""The one exception hierarchy of tessera: every error a user or a file can trigger."""

from __future__ import annotations


class TesseraError(Exception):
    """Base of every error tessera raises on bad input; the message names the value and the fix.

    ``details`` holds longer text a user may want to read (the CLI prints it with ``--verbose``).
    """

    details: str = ""


class TesseraWarning(UserWarning):
    """Something that does not stop the work but is probably not what the user meant."""


class InvalidArgument(TesseraError, ValueError):
    """An argument (memory size, device, input shape, option) is malformed or out of range."""


class UnknownDevice(InvalidArgument):
    """A device name is neither a preset nor a readable device JSON file."""


class ModelSpecError(TesseraError):
    """A model spec ("pkg.mod:builder" or "path/file.py:builder") cannot be resolved or built."""


class TraceError(TesseraError):
    """Neither torch.fx symbolic tracing nor torch.export could capture the model.

    ``details`` is what torch printed and logged while trying (torch.export's partial graph).
    """

    def __init__(self, message: str, *, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class ProfileError(TesseraError):
    """A model cannot be profiled as asked (e.g. it lives on the meta device)."""


class PlanInfeasible(TesseraError):
    """No configuration fits the memory budget; the message names the smallest budget that would."""

    def __init__(self, message: str, *, min_mem_bytes: int, binding: str) -> None:
        super().__init__(message)
        self.min_mem_bytes = min_mem_bytes
        self.binding = binding


class PlanFileError(TesseraError):
    """A plan file is unreadable, corrupt, of another schema version, or does not match."""


class SpatialError(TesseraError):
    """A layer or image cannot be split into tiles exactly; the message names the layer and the fix."""


class RuntimeSetupError(TesseraError):
    """The plan, the rebuilt model and the launched processes disagree; found before any work.

    ``same_on_every_rank`` is true when every rank detects the same mismatch (world size,
    schema version, fingerprint), so only rank 0 needs to print it.
    """

    def __init__(self, message: str, *, same_on_every_rank: bool = True) -> None:
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


class RankFailure(TesseraError):
    """A rank failed while training; every rank stops and exits non-zero."""


class PeerFailure(RankFailure):
    """This rank stopped because another rank failed, hung, or a wait timed out."""


class CheckpointError(TesseraError):
    """A checkpoint is missing, incomplete, or belongs to another plan.

    ``same_on_every_rank`` is true when every rank reads the same file (``latest.json``) and
    so meets the same error; a stage file is read by its own ranks only.
    """

    def __init__(self, message: str, *, same_on_every_rank: bool = False) -> None:
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


def describe_error(error: BaseException) -> str:
    """``"ValueError: its message's first line"`` (no closing full stop): how a one-line error quotes another."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].rstrip('.') if lines else ''}"

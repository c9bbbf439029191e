"""The one exception hierarchy of tessera: every error a user or a file can trigger."""

from __future__ import annotations


class TesseraError(Exception):
    """Base of every error tessera raises on bad input; the message names the value and the fix."""


class InvalidArgument(TesseraError, ValueError):
    """An argument (memory size, device, input shape, option) is malformed or out of range."""


class UnknownDevice(InvalidArgument):
    """A device name is neither a preset nor a readable device JSON file."""


class ModelSpecError(TesseraError):
    """A model spec ("pkg.mod:builder" or "path/file.py:builder") cannot be resolved or built."""


class TraceError(TesseraError):
    """Neither torch.fx symbolic tracing nor torch.export could capture the model."""


class ProfileError(TesseraError):
    """A model cannot be profiled as asked (e.g. it lives on the meta device)."""

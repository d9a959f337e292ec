"""What the integrations share: a step whose phases are opened and closed by a
framework's events instead of ``with`` blocks, the batch size of a framework's
batch, and the rank variables of a launcher that does not set them all."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch

import rankscope


class EventStep:
    """One step at a time, driven by events: ``begin(i)`` enters
    ``agent.step(i)``, ``switch(name)`` ends the open phase and enters ``name``,
    ``end()`` ends the phase and the step (its row is recorded). Only the public
    step API is used, entered and exited by hand, so phases never nest."""

    __slots__ = ("agent", "step", "phase", "phase_name")

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.step: Any = None
        self.phase: Any = None
        self.phase_name: Optional[str] = None

    @property
    def open(self) -> bool:
        return self.step is not None

    def begin(self, index: int) -> None:
        if self.step is not None:
            self.end()
        step = self.agent.step(index)
        step.__enter__()
        self.step = step

    def switch(self, name: str) -> None:
        if self.step is None or self.phase_name == name:
            return
        self.end_phase()
        phase = self.step.phase(name)
        phase.__enter__()
        self.phase, self.phase_name = phase, name

    def end_phase(self) -> None:
        phase, self.phase, self.phase_name = self.phase, None, None
        if phase is not None:
            phase.__exit__(None, None, None)

    def record(self, **values: Any) -> None:
        if self.step is not None:
            values = {k: v for k, v in values.items() if v is not None}
            if values:
                self.step.record(**values)

    def end(self, error: Optional[BaseException] = None) -> None:
        if self.step is None:
            return
        self.end_phase()
        step, self.step = self.step, None
        if error is None:
            step.__exit__(None, None, None)
        else:
            step.__exit__(type(error), error, error.__traceback__)


def batch_size(batch: Any) -> Optional[int]:
    """The leading dimension of the first tensor in ``batch`` (a tensor, or a
    mapping, list or tuple holding tensors), or None where there is none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return None
    for value in values:
        n = batch_size(value)
        if n is not None:
            return n
    return None


def set_rank_variables(launcher: str, **ranks: int) -> None:
    """Sets torchrun's rank variables (``RANK=0``, ``WORLD_SIZE=2``, ...) that
    ``launcher`` left unset, from what it knows, so that :func:`rankscope.init`
    reads one identity. A variable already set to another value is an error: two
    sources disagree about this rank."""
    for var, value in ranks.items():
        have = os.environ.get(var, "")
        if have == "":
            os.environ[var] = str(value)
        elif have != str(value):
            raise rankscope.ConfigError(
                f"{var}={have} but {launcher} says this process is {var}={value}: "
                f"unset {var} or launch so that both agree"
            )

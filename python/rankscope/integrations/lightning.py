"""rankscope for Lightning: one callback records every optimizer step of every rank.

    from rankscope.integrations.lightning import RankscopeCallback
    trainer = lightning.Trainer(strategy="ddp", devices=2, callbacks=[RankscopeCallback()])

Rank, world size and node come from the Lightning strategy, which knows them
whether it launched the processes itself or was launched by ``torchrun`` or SLURM;
the run id from ``RANKSCOPE_RUN_ID``, torchrun or SLURM, else rank 0 makes one
(``lightning-<secs>-<ms>``) and broadcasts it. Everything else comes from
``RANKSCOPE_*`` or the callback's keywords, which are :func:`rankscope.init`'s.

A step is one optimizer step (``trainer.global_step``): under
``accumulate_grad_batches`` its row covers the step's batches, and the layers are
sampled on its first batch. Phases: ``forward`` from ``on_train_batch_start`` to
``on_before_backward`` (``training_step``, and Lightning's ``zero_grad``),
``backward`` to ``on_after_backward``, ``optimizer`` from
``on_before_optimizer_step`` to ``on_train_batch_end``. The batch is fetched
before ``on_train_batch_start``: ``data`` is not recorded. ``loss`` is what the
step's last ``training_step`` returned (undone from Lightning's division by
``accumulate_grad_batches``), ``lr`` the first parameter group's; ``grad_norm`` is
not recorded. ``samples`` counts the examples of the step's batches.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Optional

try:
    import lightning.pytorch as pl
except ImportError as error:  # pragma: no cover: depends on the environment
    raise ImportError(
        f"rankscope.integrations.lightning needs the lightning package ({error}): "
        "pip install lightning"
    ) from error

import torch

import rankscope

from ._events import EventStep, batch_size, set_rank_variables

__all__ = ["RankscopeCallback"]


class RankscopeCallback(pl.Callback):
    """Records a Lightning Trainer's optimizer steps, the layers of the
    ``LightningModule`` and, under DDP, the gradient all-reduce
    (``steps.comm_ms``).

    ``RankscopeCallback()`` starts the agent when fitting sets up, with
    ``rankscope.init(**init_keywords)`` (``workload="lightning"`` unless given),
    and finishes it at ``on_train_end`` or on an exception.
    """

    def __init__(self, **init_keywords: Any) -> None:
        self._init_keywords = {"workload": "lightning", **init_keywords}
        self._agent: Any = None
        self._steps: Optional[EventStep] = None
        self._samples = 0
        self._stepped = False

    @property
    def agent(self) -> Any:
        """The rank's agent (None before fitting sets up)."""
        return self._agent

    # -- the run --------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit" or self._agent is not None:
            return
        # The strategy's view of this process, as torchrun would set it: Lightning's
        # own launcher sets WORLD_SIZE, LOCAL_RANK and NODE_RANK, not RANK.
        try:
            set_rank_variables(
                "the Lightning strategy",
                RANK=trainer.global_rank,
                WORLD_SIZE=trainer.world_size,
                LOCAL_RANK=trainer.local_rank,
                LOCAL_WORLD_SIZE=trainer.num_devices,
                GROUP_RANK=trainer.node_rank,
            )
        except rankscope.ConfigError as error:
            if os.environ.get("RANKSCOPE_ON_CONFIG_ERROR", "").strip().lower() != "disable":
                raise
            warnings.warn(
                f"rankscope disabled by RANKSCOPE_ON_CONFIG_ERROR=disable: {error}", RuntimeWarning, stacklevel=2
            )
            self._agent = rankscope.InertAgent()
            return
        keywords = dict(self._init_keywords)
        if keywords.get("run_id") is None and not _launcher_run_id() and trainer.world_size > 1:
            made = f"lightning-{int(time.time())}-{int(time.time() * 1000) % 1000}"
            keywords["run_id"] = trainer.strategy.broadcast(made, src=0)
        self._agent = rankscope.init(**keywords)
        if self._agent.active:
            self._steps = EventStep(self._agent)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._agent is None or not self._agent.active:
            return
        # Layers by their paths in the LightningModule (the strategy's wrappers add
        # a prefix); the all-reduce on the DDP model the strategy built.
        self._agent.watch(pl_module, comm=False)
        ddp = getattr(trainer.strategy, "model", None)
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            try:
                ddp.register_comm_hook(None, self._agent.wrap_comm_hook(allreduce_hook))
            except RuntimeError as error:
                warnings.warn(
                    f"rankscope cannot time the all-reduce ({error}), as the strategy has a "
                    "communication hook: steps.comm_ms is not recorded; pass "
                    "agent.wrap_comm_hook(hook) to DDPStrategy(ddp_comm_hook=...) instead",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._close(None)

    def on_exception(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        if self._agent is not None:
            self._agent.event("exception", f"{type(exception).__name__}: {exception}")
        self._close(exception)

    # -- a step -----------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        steps = self._steps
        if steps is None:
            return
        if not steps.open:
            steps.begin(trainer.global_step)
            self._samples = 0
            self._stepped = False
        self._samples += batch_size(batch) or 0
        steps.switch("forward")

    def on_before_backward(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor
    ) -> None:
        if self._steps is not None:
            self._steps.switch("backward")

    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._steps is not None:
            self._steps.end_phase()

    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any
    ) -> None:
        if self._steps is not None:
            self._steps.switch("optimizer")
            self._stepped = True

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        steps = self._steps
        if steps is None or not steps.open:
            return
        steps.end_phase()
        if not self._stepped:
            return  # accumulating: the optimizer step comes with a later batch
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().reshape(()) * trainer.accumulate_grad_batches
        else:
            loss = None
        lr = None
        if trainer.optimizers:
            lr = trainer.optimizers[0].param_groups[0].get("lr")
        steps.record(loss=loss, lr=lr, samples=self._samples or None)
        steps.end()

    # -- the end ------------------------------------------------------------------

    def _close(self, error: Optional[BaseException]) -> None:
        if self._steps is not None:
            self._steps.end(error)
            self._steps = None
        if self._agent is not None:
            self._agent.finish()


def _launcher_run_id() -> bool:
    """Whether the agent finds a run id that every rank shares: its own variable,
    torchrun's or SLURM's."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return bool(
        os.environ.get("RANKSCOPE_RUN_ID") or (elastic and elastic != "none") or os.environ.get("SLURM_JOB_ID")
    )

"""A `transformers.Trainer` callback: the Trainer's own loop averaged by a library peer.

    peer = shoal.sync.host("tiny-llama", task="hf", data="texts/", task_options={...})
    outer = peer.outer(peer.model)   # no optimizer: the Trainer steps its own
    trainer = transformers.Trainer(model=peer.model, args=args, train_dataset=data,
                                   callbacks=[ShoalCallback(outer)])
    trainer.train()
    peer.close()

After each optimizer step of the Trainer (`on_step_end`), the strategy's turn: every H
steps a round (averaged, committed exactly, or a re-sync when behind), which changes
the parameters in place, under the Trainer's optimizer, as `shoal run`'s outer step
changes its own. Needs the hf extra (``pip install 'shoal[hf]'``); this module imports
without it (transformers is imported at the first callback made).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from shoal.averaging.outer import RoundReport

from .api import LibraryError
from .sync import SyncOuter

__all__ = ["ShoalCallback"]


def ShoalCallback(outer: SyncOuter, tokens_per_step: int | None = None) -> Any:
    """A `transformers.TrainerCallback` that hands each of the Trainer's steps to `outer`
    (a `shoal.sync` peer's `outer(model)`, made without an optimizer). `tokens_per_step`:
    what a step trains on, which weighs this peer's contribution (default: the samples
    of a step, as the Trainer's arguments give them). Its `last_reports` are the rounds
    that ended at the last step."""
    if outer.outer.optimizer is not None:
        raise LibraryError(
            "ShoalCallback: make the outer without an optimizer (peer.outer(model)); "
            "the Trainer steps its own"
        )
    return _callback_class()(outer, tokens_per_step)


@functools.cache
def _callback_class() -> type:
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise LibraryError(
            "ShoalCallback needs transformers, which is not installed: pip install 'shoal[hf]'"
        ) from None

    class _ShoalCallback(transformers.TrainerCallback):  # type: ignore[misc,name-defined]
        def __init__(self, outer: SyncOuter, tokens_per_step: int | None) -> None:
            self.outer = outer
            self.tokens_per_step = tokens_per_step
            self.last_reports: list[RoundReport] = []
            self._logs_seen = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            tokens = self.tokens_per_step or (
                args.per_device_train_batch_size
                * args.gradient_accumulation_steps
                * max(1, args.world_size)
            )
            loss = None  # (a loss the Trainer logged since the last step, if any)
            if len(state.log_history) > self._logs_seen:
                new = state.log_history[self._logs_seen :]
                self._logs_seen = len(state.log_history)
                loss = next((h["loss"] for h in reversed(new) if "loss" in h), None)
            self.last_reports = self.outer.after_step(tokens=tokens, loss=loss)
            return control

    return _ShoalCallback

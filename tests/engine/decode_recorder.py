"""A test helper: run every step both eagerly and through the decode graph runner."""

from __future__ import annotations

import torch

from lightinfer.engine.model_runner import ModelRunner
from lightinfer.engine.scheduler import SchedulerOutput


class EagerVsGraph:
    """Replaces ``model_runner.run``: each step runs eagerly first (graph runners detached), then
    through the normal path (the graph runner where the step qualifies). Both write the step's
    K/V at the same slots and each reads its own, so doing both leaves the state of the second.
    Returns the second's logits and keeps the largest difference and the argmax agreement.

    Args:
        model_runner: the runner to wrap (its ``run`` is replaced on the instance).
    """

    def __init__(self, model_runner: ModelRunner) -> None:
        self.model_runner = model_runner
        self.inner = model_runner.run
        self.max_diff = 0.0  # largest |eager - graph| logit
        self.max_logit = 0.0  # largest |eager| logit, to judge max_diff by
        self.argmax_agree = self.rows = 0
        model_runner.run = self  # type: ignore[method-assign]

    def __call__(self, out: SchedulerOutput, all_logits: bool = False) -> torch.Tensor:
        runners = self.model_runner.graph_runner, self.model_runner.cpu_graph_runner
        self.model_runner.graph_runner = self.model_runner.cpu_graph_runner = None
        try:
            eager = self.inner(out, all_logits)
        finally:
            self.model_runner.graph_runner, self.model_runner.cpu_graph_runner = runners
        got = self.inner(out, all_logits)
        if eager.numel():
            self.max_diff = max(self.max_diff, (eager - got).abs().max().item())
            self.max_logit = max(self.max_logit, eager.abs().max().item())
            self.argmax_agree += int((eager.argmax(-1) == got.argmax(-1)).sum())
            self.rows += eager.shape[0]
        return got

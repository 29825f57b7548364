"""An actor that evaluates the global model on the held-out set while training goes on.

Training hands it θ (fire-and-forget) every `run.eval_every` outer steps; it keeps the curve of held-out
loss against tokens per worker, which the driver puts in summary.json and the benchmarks plot.
"""

from __future__ import annotations

import numpy as np
import ray
import torch

from ray_diloco import metrics
from ray_diloco.config import ExperimentConfig
from ray_diloco.data.eval_set import evaluate_loss
from ray_diloco.model import build_model, load_parameters
from ray_diloco.sharding import from_wire


class EvaluatorImpl:
    def __init__(self, config: dict, windows: torch.Tensor):
        self.cfg = ExperimentConfig.from_dict(config)
        torch.set_num_threads(1)
        self.model = build_model(self.cfg.model, self.cfg.model.vocab_size, self.cfg.data.seq_len, self.cfg.run.seed)
        self.windows = windows
        self.curve: list[dict] = []

    def evaluate(self, outer_step: int, state: dict[str, np.ndarray], tokens_per_worker: int | None = None) -> dict:
        """Held-out loss of `state` (full tensors, as `sharding.to_wire` sends them) after `outer_step` outer
        steps (or H-step blocks in ddp/single). `tokens_per_worker`: what one worker of the region that sends it
        trained so far (fewer than whole windows where a preemption notice ended one early); None: whole windows."""
        load_parameters(self.model, from_wire(state))
        loss, perplexity = evaluate_loss(self.model, self.windows, self.cfg.data.batch_size)
        if tokens_per_worker is None:
            tokens_per_worker = self.cfg.tokens_per_worker(outer_step)
        point = {"outer_step": outer_step, "tokens_per_worker": tokens_per_worker,
                 "eval_loss": loss, "eval_perplexity": perplexity}
        self.curve.append(point)
        metrics.safely(metrics.record_eval, self.cfg.run.name, outer_step, loss, perplexity)
        return point

    def get_curve(self) -> list[dict]:
        return sorted(self.curve, key=lambda p: p["outer_step"])


Evaluator = ray.remote(num_cpus=1)(EvaluatorImpl)

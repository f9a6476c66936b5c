"""Per-step metrics to `metrics.jsonl`, TensorBoard and (optionally) Weights & Biases."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from megatron_armor.config import LoggingConfig
from megatron_armor.config.builders import builds


@builds(LoggingConfig)
class MetricsLogger:
    """Appends one JSON object per step; non-finite values are written as null and listed under
    `nonfinite`. On resume, lines after `resume_from_step` are dropped so steps never repeat."""

    def __init__(self, logging: LoggingConfig, *, enabled: bool = True, resume_from_step: int | None = None) -> None:
        """The run's logger as the logging section says (run_dir, tensorboard, wandb_project); `enabled`: this rank
        writes (the main rank); `resume_from_step`: the step a resumed run continues from."""
        self.enabled = enabled
        run_dir = Path(logging.run_dir)
        self.path = run_dir / "metrics.jsonl"
        self._tb = self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None and self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_from_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif self.path.exists():
            self.path.unlink()
        if logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                warnings.warn("tensorboard is not installed; TensorBoard logging is off", stacklevel=2)
        if logging.wandb_project:
            try:
                import wandb
            except ImportError as error:
                raise RuntimeError("logging.wandb_project is set but wandb is not installed: pip install wandb") from error
            self._wandb = wandb.init(project=logging.wandb_project, dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record: dict[str, object] = {"step": step}
        nonfinite = []
        for key, value in metrics.items():
            value = float(value)
            if math.isfinite(value):
                record[key] = value
            else:
                record[key] = None
                nonfinite.append(key)
        if nonfinite:
            record["nonfinite"] = nonfinite
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        finite = {k: v for k, v in record.items() if isinstance(v, float)}
        if self._tb is not None:
            for key, value in finite.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(finite, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

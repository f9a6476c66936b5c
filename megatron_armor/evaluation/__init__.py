"""Benchmark evaluation shared by `armor eval` and validation during training: the dataset list
(`settings`), the estimators (avg@k, pass@k, maj@k: `estimators`), a dataset's metrics from its scored samples
(`scores`), the checkpoints to evaluate (`checkpoints`) and what a run of `armor eval` writes (`writers`).
Generation itself is the trainer's (`trainer/step/validation.py`), the code validation runs."""

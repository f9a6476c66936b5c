"""`armor train` on every rank: the task's files (task_setup.py, the synthetic demo's supervised warm start:
warmstart.py), every component built from the config (build.py: engines, models, data, scorers and the `RLTrainer`)
and the run loop (train.py: resume, first weight pushes, steps, validation, the collapse guard, logging, checkpoints,
teardown). Collective: every rank sets up and runs the same calls in the same order.
"""

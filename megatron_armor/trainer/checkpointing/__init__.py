"""The trainer's state on disk: Megatron distributed checkpoints of `RLTrainer.sharded_state_dict()` (the modules'
sharded state dicts: sharded_state.py; written and read shard by shard: dist_state_io.py; every rank's RNG states:
rng_state.py), their layout, record and loading (checkpoint.py), the save, at once or in the background
(checkpoint_save.py), and the run's best checkpoint by a validation metric (best_checkpoint.py). A checkpoint is
complete or absent (written under `.tmp_step_N/`, renamed once every rank wrote its shards) and loads at any
TP x PP x DP layout.
"""

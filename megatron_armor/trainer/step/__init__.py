"""The RL step: `RLTrainer` (loop.py) runs one step's phases in order (rollout, advantages, logprobs, update, weight
sync, MIPU gate, subspace capture, reference reset) over the parts the lower sub-packages provide, holds the state a
resumed run needs (`state_dict`, `sharded_state_dict`, `load_state_dict`) and closes the background work it owns
(`close`); `evaluate` validates an engine. It owns no I/O besides the engines' (metrics and checkpoint files are the
run's).
"""

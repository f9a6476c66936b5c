"""Sequence batches and token logprobs through Megatron's forward schedules, shared by the trainer and the OPD teacher."""

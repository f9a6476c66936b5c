"""megatron-armor: ARMOR RL post-training on Megatron-Core."""

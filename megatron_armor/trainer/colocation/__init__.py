"""Who holds what, when: a GPU shared between the trainer and colocated rollout servers, and one rollout engine shared
between the actor's and the reference's weights. `Colocation` (colocation.py) calls the servers' `MemoryHandoff`
(memory_handoff.py) and the trainer's `TrainerOffload` (offload.py) in the order the colocated tests pin, and does
nothing without them, so the RL step calls it unconditionally; `EngineWeights` (engine_weights.py) pushes each
policy's weights into its engine through it and keeps which policy's weights a shared engine holds
(`Policy.holds_weights`), the same on every rank.
"""

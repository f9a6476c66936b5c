"""Memory and FLOP planning of a run's layout (`armor plan`): per-GPU bytes of every part of training, whether
they fit a GPU, which knob to turn when they do not, and the training FLOPs of one RL step (also logged by the
trainer as `perf/tflops_per_gpu`). Nothing here allocates a model: the numbers come from the model's shape.

Modules: flops (Megatron's FLOP formula), memory (layout, model-state bytes), activations (saved activations,
LM-head logits), shapes (model shapes), planner (a run's MemoryPlan from its config), report and cli (`armor plan`).
"""

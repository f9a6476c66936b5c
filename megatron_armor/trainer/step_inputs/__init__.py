"""What every phase of an RL step reads: `StepPlan` (plan.py: the algorithm object and the sections the step
runs by, joined once when the run is built and replaced whole, never changed in place) and `PolicyHandles`
(policies.py: this rank's `Policy` objects, actor, reference and teacher: model, engine, which weights the engine
holds, how the policy scores a batch and is checkpointed). It holds none of the step's phases; it imports no other
sub-package of the trainer, so every one of them may read it.
"""

"""What every phase of an RL step reads: `StepPlan` (plan.py: the algorithm object and the batch geometry,
derived from the config once and replaced whole, never changed in place) and `PolicyHandles` (policies.py: this
rank's models and rollout engines). Plain data that holds none of the step's behaviour; it imports no other
sub-package of the trainer, so every one of them may read it.
"""

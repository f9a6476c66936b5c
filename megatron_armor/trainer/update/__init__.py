"""From a step's kept groups to the actor's new weights: the advantage and logprob phases (training_batch.py), one
optimizer step per mini-batch with the algorithm's loss (policy_update.py, with moe_metrics.py's router metrics) on
Megatron DDP and Adam with the lr warmup (optimizer.py), and what undoes an update: a non-finite loss or gradient found
before its optimizer step (faults.py), the MIPU gate over held-out prompts (update_gate.py) and the
`TrainingSnapshot` both restore from (snapshot.py). Every rank takes the same skip, accept or rollback decision.
"""

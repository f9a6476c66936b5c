"""The RL trainer of `armor train`, split by concern into sub-packages layered bottom to top, each importing only
those below it (tests/test_package_layers.py, `TRAINER_LAYERS`): `step_inputs` (what an RL step reads), `colocation`
(who holds the GPU and which weights the engines hold), `rollouts` (a step's samples: generated, scored, grouped, and
when), `update` (from kept groups to optimizer steps, and what undoes one), `checkpointing` (the trainer's state on
disk), `step` (`RLTrainer`: the RL step and the state a resumed run needs), `guard` (the collapse monitor in the run
loop) and `run` (set-up and the run loop).
"""

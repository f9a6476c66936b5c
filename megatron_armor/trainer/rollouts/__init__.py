"""A step's rollouts: samples generated over all ranks and scored (samples.py), grouped until the batch is full
(rollout_phase.py) from the sources the algorithm names, among them the extra sources whose samples join the groups
(extra_sources.py: what the phase asks of them), ARMOR's anchors the one there is (anchors.py: sampled by the
reference before or after the on-policy samples, cached per reference by anchor_cache.py, or sampled ahead on a thread
of their own by anchor_prefetch.py when a schedule asks for it), and when all of it runs (`RolloutSchedule` by
rollout.mode: rollout_schedule.py for `sync` and `one_step_off`, async_rollouts.py for `async`). Every rank gets the
same `Rollout`, tagged with the weight versions that sampled it; the background modes' threads run their collectives
over a gloo group of their own, leave the actor's engine still before its weights are pushed (`settle`) and no
collective in flight once closed (`close`).
"""

"""The collapse guard of the run loop: each step's metrics go through the collapse monitor (`CollapseWatch`,
collapse_watch.py), whose stop and anchor alarms every rank agrees on, and an anchor alarm restarts the trainer as
ARMOR from the best checkpoint (`AnchorSwitch`, anchor_switch.py). Their state rides in every checkpoint beside the
trainer's; off (the default), nothing is observed or logged.
"""

"""Multi-turn, tool-using rollouts: token-exact trajectories (trajectory.py, render.py), environments and tools
(environment.py, tool_env.py, tools.py, sandbox.py), the rollout-function API and per-trajectory concurrency
(driver.py, generate.py), their metrics (metrics.py), and chat templates written here (chat_templates.py). Below the
trainer, above the rollout engines (docs/guides/agentic.md)."""

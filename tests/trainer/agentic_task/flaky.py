"""A one-turn environment for the trajectory scorer's tests: reward 1 whatever the policy says; a row with
`fail: k` raises in `reset` the first k times it is rolled out (`attempts` counts rollouts per prompt)."""

from megatron_armor.agentic.environment import Environment, EnvReply


class Flaky(Environment):
    attempts: dict[str, int] = {}

    def reset(self, row):
        seen = Flaky.attempts[row["prompt"]] = Flaky.attempts.get(row["prompt"], 0) + 1
        if seen <= row.get("fail", 0):
            raise RuntimeError("flaky environment")
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        return EnvReply(done=True)

    def score(self, messages):
        return 1.0

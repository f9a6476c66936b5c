"""A two-turn environment on the synthetic arithmetic task, for the tests that train on trajectories: after the
policy's first answer a tool message repeats the question (on a new line), the policy answers again, and the
episode ends. The reward is the arithmetic verifier's best over both answers (+1 or -1); `TwoTurnParity`'s is the
parity of the answers' length (an untrained model's groups then mix rewards: the layout tests' rolled-out steps)."""

from megatron_armor.agentic.environment import Environment, EnvReply
from megatron_armor.rewards.arithmetic import verify


class TwoTurnArithmetic(Environment):
    def reset(self, row):
        self.row = row
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        if sum(m["role"] == "assistant" for m in messages) >= 2:
            return EnvReply(done=True)
        return EnvReply([{"role": "tool", "content": "\n" + self.row["prompt"]}], tool_calls=1)

    def score(self, messages):
        return max(verify(m["content"], self.row)[0] for m in messages if m["role"] == "assistant")


class TwoTurnParity(TwoTurnArithmetic):
    def score(self, messages):
        """+1 when the policy's answers together hold an even number of characters, else -1."""
        return 1.0 if sum(len(m["content"]) for m in messages if m["role"] == "assistant") % 2 == 0 else -1.0

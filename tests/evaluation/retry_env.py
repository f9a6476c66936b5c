"""The environment of the agentic dataset in tests/evaluation/test_eval_run.py: the arithmetic task where each answer
is checked like a tool call (a tool error when it is wrong); a wrong first answer is shown the question again (a tool
message on a new line) and the second answer ends the episode. The reward is the last answer's verdict (+1 or -1)."""

from megatron_armor.agentic.environment import Environment, EnvReply
from megatron_armor.rewards.arithmetic import verify


class RetryArithmetic(Environment):
    def reset(self, row):
        self.row = row
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        wrong = not verify(messages[-1]["content"], self.row)[1]
        done = not wrong or sum(m["role"] == "assistant" for m in messages) >= 2
        again = [] if done else [{"role": "tool", "content": "\n" + self.row["prompt"]}]
        return EnvReply(again, done=done, tool_calls=1, tool_errors=int(wrong))

    def score(self, messages):
        return verify(messages[-1]["content"], self.row)[0]

"""Math with code: the policy may run Python in the sandbox (agentic/sandbox.py) before it answers."""

import re

from megatron_armor.agentic.sandbox import PythonSandbox, python_tool
from megatron_armor.agentic.tool_env import ToolEnv

ANSWER = re.compile(r"Answer:\s*(\S+)\s*$")


class PythonMathEnv(ToolEnv):
    def __init__(self):
        super().__init__([python_tool(PythonSandbox(timeout_s=5, memory_mb=512))])

    def reset(self, row):
        self.answer = str(row["answer"])
        return [{"role": "system", "content": "You may run Python with the python tool. "
                                              "End with 'Answer: <value>'."},
                {"role": "user", "content": row["prompt"]}]

    def score(self, messages):
        found = ANSWER.search(messages[-1]["content"])
        return float(found is not None and found.group(1) == self.answer)

"""A sandboxed Python tool: model-written code in a subprocess with time, memory and output limits, no network and a
fresh working directory, behind the `Sandbox` interface an external sandbox can implement too.

Threat model. The sandbox keeps honest mistakes and careless code of the policy from harming the run: an endless
loop (killed at `timeout_s`, its whole process group), a memory blow-up (RLIMIT_AS), a flood of output (the pipe
is read up to `max_output_bytes`, then the process is killed), stray files (a fresh temporary directory, removed
after; RLIMIT_FSIZE caps a file's size), fork bombs (RLIMIT_NPROC where the user is not root), network use (a new
network namespace where the kernel lets an unprivileged user make one, else Python's socket module is disabled in
the child). It is NOT a security boundary against code written to escape: the child runs as the trainer's user, can
read whatever that user can read (the file system, environment variables are cleared but /proc is not), and the
socket block without a namespace is a Python-level patch that `ctypes` or a subprocess undoes. For untrusted code or
hostile tasks, implement `Sandbox.run` with a container runtime (`docker run --rm --network none --memory ...
python -c ...`) or a remote execution service and give it to `python_tool`; nothing else changes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Protocol

from megatron_armor.agentic.tools import MAX_OUTPUT_BYTES, Tool

# Run in the child before the user's code (argv: memory limit in bytes, file-size limit in bytes).
_BOOTSTRAP = """
import resource, sys
memory, file_size = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
try:
    import os
    if os.getuid() != 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
    os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET)
except (AttributeError, OSError, ValueError):
    import socket
    def _no_network(*args, **kwargs):
        raise OSError("network access is disabled in the sandbox")
    socket.socket = socket.create_connection = socket.getaddrinfo = _no_network
del resource, sys, memory, file_size
import runpy
runpy.run_path("main.py", run_name="__main__")
"""


@dataclass(frozen=True)
class SandboxResult:
    """What a run of code gave. stdout/stderr: decoded (invalid bytes replaced), at most the output limit in all;
    exit_code: the process's (negative: killed by that signal); timed_out / output_truncated: a limit stopped it."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    output_truncated: bool = False

    def as_text(self) -> str:
        """The result as the policy reads it."""
        parts = [self.stdout] + ([f"[stderr]\n{self.stderr}"] if self.stderr else [])
        if self.timed_out:
            parts.append("[killed: time limit]")
        elif self.output_truncated:
            parts.append("[killed: output limit]")
        elif self.exit_code != 0:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(p for p in parts if p)


class Sandbox(Protocol):
    """Runs a Python program and reports what it printed; its own limits apply."""

    async def run(self, code: str) -> SandboxResult: ...


@dataclass(frozen=True)
class PythonSandbox:
    """`Sandbox` in a local subprocess (module docstring for what it isolates). timeout_s: wall clock; memory_mb:
    address-space limit; max_output_bytes: stdout and stderr together."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = MAX_OUTPUT_BYTES
    python: str = sys.executable

    async def run(self, code: str) -> SandboxResult:
        with tempfile.TemporaryDirectory(prefix="armor-sandbox-") as workdir:
            with open(os.path.join(workdir, "main.py"), "w") as f:
                f.write(code)
            process = await asyncio.create_subprocess_exec(
                self.python, "-I", "-c", _BOOTSTRAP, str(self.memory_mb << 20), str(self.max_output_bytes),
                cwd=workdir, env={"PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"},
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            try:
                return await self._collect(process)
            finally:  # a time-out, an output flood or a cancelled call: the whole group goes
                if process.returncode is None:
                    _kill_group(process.pid)
                    await process.wait()

    async def _collect(self, process: asyncio.subprocess.Process) -> SandboxResult:
        budget = [self.max_output_bytes]  # shared by both streams
        truncated = asyncio.Event()

        async def read(stream: asyncio.StreamReader) -> bytes:
            out = bytearray()
            while chunk := await stream.read(65536):
                room = budget[0]
                out += chunk[:room]
                budget[0] -= min(len(chunk), room)
                if len(chunk) > room:
                    truncated.set()
                    _kill_group(process.pid)
                    break
            return bytes(out)

        readers = asyncio.gather(read(process.stdout), read(process.stderr))
        try:
            stdout, stderr = await asyncio.wait_for(readers, self.timeout_s)
            await asyncio.wait_for(process.wait(), self.timeout_s)
        except TimeoutError:
            _kill_group(process.pid)
            await process.wait()
            return SandboxResult("", "", process.returncode, timed_out=True)
        return SandboxResult(stdout.decode(errors="replace"), stderr.decode(errors="replace"), process.returncode,
                             output_truncated=truncated.is_set())


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def python_tool(sandbox: Sandbox = PythonSandbox(), *, timeout_s: float | None = None) -> Tool:
    """The `python` tool: runs the `code` argument in `sandbox` and returns what it printed. Its time-out (default:
    the sandbox's plus 5 s) only catches a sandbox that does not keep its own."""

    async def python(code: str) -> str:
        """Run a Python program; returns what it printed (stdout, then stderr)."""
        return (await sandbox.run(code)).as_text()

    limit = timeout_s if timeout_s is not None else getattr(sandbox, "timeout_s", 30.0) + 5.0
    return Tool(python, {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                timeout_s=limit)

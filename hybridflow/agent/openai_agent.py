"""`openai_agent`: a black-box agent (a user's function or command) plays each trajectory through
the run's OpenAI-compatible endpoint (`openai_server.py`); its session's tokens are the trajectory.

    function   `module:function` or `/path/file.py:function`:
               async def rollout(client: openai.AsyncOpenAI, row: dict) -> float | dict
    command    run per trajectory (split like a shell; no shell) with OPENAI_BASE_URL, OPENAI_API_KEY
               and OPENAI_MODEL set for its session and the row as JSON on stdin; its last stdout line
               is the reward: a number or {"reward": x, ...}
    sandbox    (with command) the command runs in the OS sandbox (hybridflow/agent/sandbox): no network
               but its session's endpoint, which it reaches through a bridge on the sandbox's own
               127.0.0.1 (sandbox/bridge.py) and a Unix socket of the endpoint bound in; a read-only
               view of /usr, its program's installation (``<prefix>`` of ``<prefix>/bin/program`` and of
               the file that links to, e.g. a venv and its base Python), each argument that names an
               existing path (that file itself, not its directory) and the paths in `sandbox_paths`;
               a private writable /tmp; the limits of `sandbox_limits`.
    sandbox_paths  (with sandbox) more host paths the sandboxed command sees, read-only: e.g. the
               directory of modules its script imports.

`row`: {"messages": the row's prompt, "extra_info": ..., "model": the served model name}. The reward
is the trajectory's agent reward (added to the data_source's rule reward, as an environment's is).
An agent that raises, exits non-zero, prints no reward or runs past `timeout_s` scores 0 and is
counted (`agent/agent_errors`, `agent/agent_timeouts`); its session's tokens so far are still the
trajectory (masked and scored like any other). The user's code is trusted as the user's; what the
*model* writes reaches it only as the endpoint's replies.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

from hybridflow.agent.loop import AgentLoop, RequestBatcher, Trajectory, register_agent_loop
from hybridflow.agent.format import apply_chat_template_with_tools
from hybridflow.agent.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from hybridflow.agent.threads import in_own_thread
from hybridflow.config.validate import register_check

STDOUT_KEEP = 65536  # bytes of a command's stdout kept (the reward is its last line)
STDERR_KEEP = 4096
BRIDGE_SOURCE = (Path(__file__).parent / "sandbox" / "bridge.py").read_text()
SOCKET_INSIDE = "/run/hybridflow/endpoint.sock"  # where a sandboxed agent's endpoint socket is bound
BRIDGE_PORT = 8000  # on the sandbox's own loopback: no other process shares that network namespace


@dataclass(frozen=True)
class BlackBoxAgent:
    """actor_rollout_ref.rollout.agent: which agent, how long one trajectory may take, and whether the
    command runs in the OS sandbox."""

    function: str | None = None
    command: str | None = None
    timeout_s: float = 300.0
    sandbox: bool = False
    sandbox_paths: tuple[str, ...] = ()  # more host paths a sandboxed command sees (absolute, existing)


def sandbox_limits(timeout_s: float) -> SandboxLimits:
    """A sandboxed agent's limits: its trajectory's time (wall and summed CPU), 1 GiB of memory for
    the whole sandbox (an interpreter with an HTTP client and its threads), 64 processes/threads."""
    return SandboxLimits(cpu_s=timeout_s, wall_s=timeout_s, memory_mb=1024, max_procs=64, output_bytes=STDOUT_KEEP, open_files=256)


def sandboxed_command(command: str, paths: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """(argv with its host paths made absolute, the host paths a sandboxed run of it must see).

    What the program needs and nothing near it: a command run at a checkout's root must not show the
    checkout (the answers, the reward code) because its script lives there. So the view holds
    - the program's installation: `<prefix>` when it lives in `<prefix>/bin` (a venv, /usr/local), else
      the program file itself; the same for the file it links to (a venv's python -> its base
      interpreter), and for a venv the prefix of its pyvenv.cfg `home`, where Python looks for the
      base's standard library;
    - each argument that names an existing path: that path itself (a script file, not its directory);
    - `paths` (actor_rollout_ref.rollout.agent.sandbox_paths): anything else, e.g. the modules a script imports.
    Symbolic links on the way are kept and their targets shown (Sandbox resolves `show`)."""
    argv = shlex.split(command)
    program = os.path.abspath(shutil.which(argv[0]) or argv[0])
    show: list[str] = []
    for path in dict.fromkeys([program, os.path.realpath(program)]):
        folder = os.path.dirname(path)
        if os.path.basename(folder) != "bin":
            show.append(path)
            continue
        prefix = os.path.dirname(folder)
        show.append(prefix)
        home = venv_home(prefix)
        if home:
            show.append(os.path.dirname(home) if os.path.basename(home.rstrip("/")) == "bin" else home)
    args = []
    for a in argv[1:]:
        if os.path.exists(a):
            a = os.path.abspath(a)
            show.append(a)
        args.append(a)
    show += paths
    return [program, *args], [p for p in dict.fromkeys(show) if p != "/"]


def venv_home(prefix: str) -> str | None:
    """The `home` of `<prefix>/pyvenv.cfg` (the base interpreter's directory), when prefix is a venv."""
    try:
        with open(os.path.join(prefix, "pyvenv.cfg")) as f:
            for line in f:
                key, eq, value = line.partition("=")
                if eq and key.strip() == "home" and os.path.isabs(value.strip()) and os.path.exists(value.strip()):
                    return value.strip()
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=4)
def agent_sandbox(command: str, paths: tuple[str, ...] = ()) -> tuple[Sandbox, list[str]]:
    """The sandbox a command runs in (made and tried once per process) and its argv."""
    argv, show = sandboxed_command(command, paths)
    return Sandbox(show=show), argv


@functools.lru_cache(maxsize=8)
def load_function(spec: str) -> Callable[..., Awaitable[Any]]:
    """`module:function` or `/path/file.py:function` -> the function (ValueError naming the spec)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"actor_rollout_ref.rollout.agent.function={spec!r}: expected module:function or /path/file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where)
            mod_spec = importlib.util.spec_from_file_location(f"hybridflow_agent_{path.stem}", path)
            if mod_spec is None or not path.is_file():
                raise FileNotFoundError(where)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        fn = getattr(module, name)
    except (ImportError, AttributeError, FileNotFoundError, SyntaxError) as e:
        raise ValueError(f"actor_rollout_ref.rollout.agent.function={spec!r}: cannot load it ({type(e).__name__}: {e})") from None
    if not asyncio.iscoroutinefunction(fn):
        raise ValueError(f"actor_rollout_ref.rollout.agent.function={spec!r} must be `async def rollout(client, row)`")
    return fn


@register_check("black_box_agent")
def agent_problems(function: str | None, command: str | None, multi_turn: bool, sandbox: bool = False,
                   sandbox_paths: Sequence[str] = ()) -> list[str]:
    """Config checks before any worker starts."""
    key = "actor_rollout_ref.rollout.agent"
    out = []
    paths_ok = True
    for path in sandbox_paths or ():
        if not isinstance(path, str) or not os.path.isabs(path) or not os.path.exists(path):
            out.append(f"{key}.sandbox_paths: {path!r} is not an absolute path that exists (the sandboxed command sees them read-only)")
            paths_ok = False
        elif os.path.realpath(path) == "/":
            out.append(f"{key}.sandbox_paths: {path!r} would show the whole file system to the sandboxed command")
            paths_ok = False
    if sandbox_paths and not sandbox:
        out.append(f"{key}.sandbox_paths is set but {key}.sandbox is not: the paths are for a sandboxed command")
    if not function and not command:
        return out
    if function and command:
        out.append(f"{key}.function and {key}.command are both set; an agent is one or the other")
    if not multi_turn:
        out.append(f"{key}.{'function' if function else 'command'} needs actor_rollout_ref.rollout.multi_turn.enable=true "
                   f"(the agent's requests become multi-turn trajectories)")
    if function:
        try:
            load_function(function)
        except ValueError as e:
            out.append(str(e))
    if command:
        try:
            argv = shlex.split(command)
        except ValueError as e:
            argv = []
            out.append(f"{key}.command={command!r}: {e}")
        if argv and not (os.path.isfile(argv[0]) or shutil.which(argv[0])):
            out.append(f"{key}.command={command!r}: {argv[0]!r} is not a file or a program on PATH")
        elif argv and sandbox and paths_ok:
            try:
                agent_sandbox(command, tuple(sandbox_paths or ()))
            except (SandboxUnavailable, ValueError) as e:
                out.append(f"{key}.sandbox=true: no sandbox for {command!r} here: {e}")
    if sandbox and function:
        out.append(f"{key}.sandbox=true applies to {key}.command (a function runs in the driver's process); "
                   f"run the agent as a command to sandbox it")
    return out


def parse_reward(line: str) -> float:
    """A command's last stdout line -> its reward (ValueError when it is not one)."""
    value = json.loads(line)
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the agent's last output line is not a reward (a number or {{\"reward\": x}}): {line[:120]!r}")
    return float(value)


def jsonable(x: Any) -> Any:
    """Parquet rows carry numpy arrays and scalars; JSON wants lists and numbers."""
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return jsonable(x.tolist())
    return x


async def _read_tail(stream: asyncio.StreamReader, keep: int) -> bytes:
    buf = b""
    while chunk := await stream.read(65536):
        buf = (buf + chunk)[-keep:]
    return buf


def last_reward(stdout: str) -> float:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("the agent command printed no reward")
    return parse_reward(lines[-1])


async def run_sandboxed(command: str, row: Mapping[str, Any], env: Mapping[str, str], socket_path: str, timeout_s: float,
                        paths: tuple[str, ...] = ()) -> float:
    """`run_command` in the sandbox: the bridge (sandbox/bridge.py) runs the command and forwards
    127.0.0.1:BRIDGE_PORT to the endpoint's socket; OPENAI_BASE_URL points at the bridge. `paths`:
    more host paths the command sees (sandbox_paths)."""
    sandbox, argv = agent_sandbox(command, tuple(paths))
    bridge = [sandbox.python, "-I", "-S", "-B", "bridge.py", SOCKET_INSIDE, str(BRIDGE_PORT), "--", *argv]
    res = await in_own_thread(sandbox.run, bridge, sandbox_limits(timeout_s), stdin=json.dumps(jsonable(row)),
                                  files={"bridge.py": BRIDGE_SOURCE}, env=env, sockets={SOCKET_INSIDE: socket_path})
    if res.timed_out:
        raise TimeoutError(res.killed_reason)
    if not res.ok:
        raise RuntimeError(f"the sandboxed agent command {res.killed_reason or f'exited {res.exit_code}'}: {res.stderr[-400:]}")
    if res.truncated:
        raise ValueError(f"the sandboxed agent command wrote over {STDOUT_KEEP} bytes; its reward line was dropped")
    return last_reward(res.stdout)


async def run_command(command: str, row: Mapping[str, Any], env: Mapping[str, str], timeout_s: float) -> float:
    """The command's reward; raises on a non-zero exit, no reward, or TimeoutError (the process
    group is killed)."""
    proc = await asyncio.create_subprocess_exec(*shlex.split(command), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env={**os.environ, **env}, start_new_session=True)
    try:
        async def talk() -> tuple[bytes, bytes]:
            proc.stdin.write(json.dumps(jsonable(row)).encode())
            await proc.stdin.drain()
            proc.stdin.close()
            out = await asyncio.gather(_read_tail(proc.stdout, STDOUT_KEEP), _read_tail(proc.stderr, STDERR_KEEP))
            await proc.wait()
            return out[0], out[1]

        out, err = await asyncio.wait_for(talk(), timeout_s)
    finally:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the agent command exited {proc.returncode}: {err.decode(errors='replace')[-400:]}")
    return last_reward(out.decode(errors="replace"))


@register_agent_loop("openai_agent")
class OpenAIAgentLoop(AgentLoop):
    """One trajectory = one session of the endpoint, played by the configured black-box agent."""

    @classmethod
    def step_resources(cls, tokenizer, settings, batcher: RequestBatcher):
        """The step's endpoint, served on this event loop while the step's trajectories run."""
        if settings.black_box is None or settings.endpoint is None:
            raise ValueError("openai_agent needs actor_rollout_ref.rollout.agent.function or .command")
        # imported here: the server (FastAPI on uvicorn) is needed by runs with a black-box agent only,
        # not by validating a config (which imports this module's checks) or a torchrun-only install
        from hybridflow.agent.openai_server import LiveEndpoint

        return LiveEndpoint(settings.endpoint, tokenizer, batcher, settings.processor).serve()

    async def run(self, row: Mapping[str, Any], batcher: RequestBatcher) -> Trajectory:
        agent, endpoint = self.s.black_box, self.shared
        session = endpoint.open_session()
        agent_row = {"messages": jsonable(list(row.get("raw_prompt") or [])), "extra_info": jsonable(dict(row.get("extra_info") or {})),
                     "model": endpoint.s.model_name}
        reward, error, timeout = 0.0, "", False
        try:
            if agent.function:
                import openai

                client = openai.AsyncOpenAI(base_url=endpoint.url(session), api_key=session.key, max_retries=0, timeout=agent.timeout_s,
                                            http_client=endpoint.http)  # the step's shared pool: not closed here
                out = await asyncio.wait_for(load_function(agent.function)(client, agent_row), agent.timeout_s)
                reward = parse_reward(json.dumps(out))
            else:
                env = {"OPENAI_API_KEY": session.key, "OPENAI_MODEL": endpoint.s.model_name, "PYTHONUNBUFFERED": "1"}
                if agent.sandbox:
                    env["OPENAI_BASE_URL"] = endpoint.url(session, f"http://127.0.0.1:{BRIDGE_PORT}")
                    reward = await run_sandboxed(agent.command, agent_row, env, endpoint.socket_path, agent.timeout_s,
                                                 agent.sandbox_paths)
                else:
                    env["OPENAI_BASE_URL"] = endpoint.url(session)
                    reward = await run_command(agent.command, agent_row, env, agent.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            timeout, error = True, f"the agent ran past actor_rollout_ref.rollout.agent.timeout_s={agent.timeout_s}"
        except Exception as e:  # noqa: BLE001 - a failing agent scores 0 and is counted; the run goes on
            error = f"{type(e).__name__}: {e}"
        finally:
            endpoint.close_session(session)
        traj = session.trajectory()
        if traj is None:  # the agent made no request: an empty response to the row's prompt
            ids = apply_chat_template_with_tools(self.tok, [dict(m) for m in row.get("raw_prompt") or []], None, self.s.format)
            traj = Trajectory(prompt_ids=list(ids)[-endpoint.s.max_prompt_tokens:], session=session.id, finish="no_request")
        traj.reward += reward
        traj.retokenization_mismatch, traj.tool_calls = session.mismatches, session.tool_calls
        traj.dropped_segments, traj.sampling_overridden = session.dropped_segments, session.sampling_overridden
        traj.agent_error, traj.agent_timeout, traj.session_kind = error, timeout, "openai"
        if error:
            print(f"[hybridflow] openai_agent: session {session.id[:8]}: {error[:300]}", file=sys.stderr)
        return traj

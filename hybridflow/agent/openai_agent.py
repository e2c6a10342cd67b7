"""`openai_agent`: a black-box agent (a user's function or command) plays each trajectory through
the run's OpenAI-compatible endpoint (`openai_server.py`); its session's tokens are the trajectory.

    function   `module:function` or `/path/file.py:function`:
               async def rollout(client: openai.AsyncOpenAI, row: dict) -> float | dict
    command    run per trajectory (split like a shell; no shell) with OPENAI_BASE_URL, OPENAI_API_KEY
               and OPENAI_MODEL set for its session and the row as JSON on stdin; its last stdout line
               is the reward: a number or {"reward": x, ...}

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
from typing import Any, Awaitable, Callable, Mapping

from hybridflow.agent.loop import AgentLoop, RequestBatcher, Trajectory, register_agent_loop
from hybridflow.agent.format import apply_chat_template_with_tools
from hybridflow.agent.openai_server import LiveEndpoint
from hybridflow.config.validate import register_check

STDOUT_KEEP = 65536  # bytes of a command's stdout kept (the reward is its last line)
STDERR_KEEP = 4096


@dataclass(frozen=True)
class BlackBoxAgent:
    """actor_rollout_ref.rollout.agent: which agent, and how long one trajectory may take."""

    function: str | None = None
    command: str | None = None
    timeout_s: float = 300.0


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
def agent_problems(function: str | None, command: str | None, multi_turn: bool) -> list[str]:
    """Config checks before any worker starts."""
    key = "actor_rollout_ref.rollout.agent"
    if not function and not command:
        return []
    out = []
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
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    if not lines:
        raise ValueError("the agent command printed no reward")
    return parse_reward(lines[-1])


@register_agent_loop("openai_agent")
class OpenAIAgentLoop(AgentLoop):
    """One trajectory = one session of the endpoint, played by the configured black-box agent."""

    @classmethod
    def step_resources(cls, tokenizer, settings, batcher: RequestBatcher):
        """The step's endpoint, served on this event loop while the step's trajectories run."""
        if settings.black_box is None or settings.endpoint is None:
            raise ValueError("openai_agent needs actor_rollout_ref.rollout.agent.function or .command")
        return LiveEndpoint(settings.endpoint, tokenizer, batcher).serve()

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
                env = {"OPENAI_BASE_URL": endpoint.url(session), "OPENAI_API_KEY": session.key, "OPENAI_MODEL": endpoint.s.model_name,
                       "PYTHONUNBUFFERED": "1"}
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

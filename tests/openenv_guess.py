"""An OpenEnv environment served locally: guess a digit (the target comes through reset's kwargs);
reward 1 on the right guess, done after it or 3 turns. `serve()` starts its server in a thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
from pydantic import Field


class GuessAction(Action):
    text: str = Field(..., description="the model's turn")


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self.target = State(), 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, target: int = 7, **kw: Any) -> GuessObservation:
        self._state, self.target = State(episode_id=episode_id or str(uuid4()), step_count=0), int(target)
        return GuessObservation(prompt="Guess my digit.", reward=None, done=False)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kw: Any) -> GuessObservation:
        self._state.step_count += 1
        ok = action.text.strip().endswith(str(self.target))
        done = ok or self._state.step_count >= 3
        return GuessObservation(prompt="Correct!" if ok else "No.", reward=1.0 if ok else 0.0, done=done)

    @property
    def state(self) -> State:
        return self._state


def serve():
    """(base URL, stop()) of the env's server on 127.0.0.1."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_fastapi_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=64)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="websockets"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(timeout=5)

    return f"http://127.0.0.1:{port}", stop

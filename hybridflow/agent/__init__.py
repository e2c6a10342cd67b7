"""Multi-turn agent rollouts: tools, tool-call formats, environments (and the loop that drives them).

- ``tools``:  ``Tool`` base class + registry (``@register_tool``), verl-shaped tool YAML
  (``load_tool_config``), ``ToolSession`` (one trajectory's tool instances), built-ins
  ``calculator`` and ``python`` (the latter runs code in ``hybridflow.agent.sandbox``).
- ``format``: tool-call formats by name (``hermes``), tool schemas into the prompt, and the token
  delta of a tool / environment message (the model's own tokens are never re-encoded).
- ``envs``:   gym-like ``Environment`` (``reset(row)`` / ``step(text)``) by name, built-in ``guess``.

Importing this package is cheap (no torch, no sandbox); the sandbox is imported on first use.
"""

from hybridflow.agent.envs import EnvStep, Environment, GuessNumberEnv, make_env, make_env_for_row, register_env
from hybridflow.agent.format import (
    ChatTemplateError,
    ParsedResponse,
    ToolCallFormat,
    apply_chat_template_with_tools,
    get_format,
    message_delta_ids,
    register_format,
    turn_end_ids,
)
from hybridflow.agent.tools import (
    CalculatorTool,
    PythonTool,
    Tool,
    ToolCall,
    ToolConfigError,
    ToolResult,
    ToolSession,
    ToolSetupError,
    get_tool_class,
    load_tool_config,
    make_tool,
    register_tool,
)

__all__ = [
    "CalculatorTool",
    "ChatTemplateError",
    "EnvStep",
    "Environment",
    "GuessNumberEnv",
    "ParsedResponse",
    "PythonTool",
    "Tool",
    "ToolCall",
    "ToolCallFormat",
    "ToolConfigError",
    "ToolResult",
    "ToolSession",
    "ToolSetupError",
    "apply_chat_template_with_tools",
    "get_format",
    "get_tool_class",
    "load_tool_config",
    "make_env",
    "make_env_for_row",
    "make_tool",
    "message_delta_ids",
    "register_env",
    "register_format",
    "register_tool",
    "turn_end_ids",
]

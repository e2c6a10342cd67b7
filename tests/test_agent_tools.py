"""Agent building blocks: calculator, tool YAML, hermes parsing, chat-template deltas, guess env.

All offline and in-process (no Ray, no sandbox process): async tool calls run under asyncio.run.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest
import yaml

from hybridflow.agent.envs import GuessNumberEnv, make_env, make_env_for_row
from hybridflow.agent.format import (
    ChatTemplateError,
    apply_chat_template_with_tools,
    get_format,
    message_delta_ids,
    template_supports_tools,
    turn_end_ids,
)
from hybridflow.data.chat import chat_ids
from hybridflow.agent.tools import (
    CalculatorTool,
    PythonTool,
    Tool,
    ToolCall,
    ToolConfigError,
    ToolResult,
    ToolSession,
    ToolSetupError,
    function_schema,
    get_tool_class,
    load_tool_config,
    sandbox_result_to_tool_result,
)


def run(coro):
    return asyncio.run(coro)


def calc(expr: str, **config) -> ToolResult:
    tool = CalculatorTool(config)
    return run(tool.execute(run(tool.create()), {"expression": expr}))


# ------------------------------------------------------------------------------------ calculator
@pytest.mark.parametrize(
    "expr,want",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("2 ** 3 ** 2", "512"),  # right-associative
        ("-3 ** 2", "-9"),  # ** binds tighter than unary -
        ("(-3) ** 2", "9"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("10 - 4 - 3", "3"),  # left-associative
        ("2 * (3 + 4) - 10 / 5", "12"),
        ("0.1 + 0.2", "0.3"),  # 15 significant digits: float noise dropped
        ("2 ** -2", "0.25"),
        ("123456789 * 987654321", "121932631112635269"),  # ints stay exact
    ],
)
def test_calculator_values(expr, want):
    res = calc(expr)
    assert not res.error and res.text == want


def test_calculator_division_by_zero_is_a_tool_error():
    for expr in ("1 / 0", "5 // 0", "5 % 0", "0 ** -1"):
        res = calc(expr)
        assert res.error and "division by zero" in res.text


@pytest.mark.parametrize(
    "expr",
    ["__import__('os')", "__import__('os').system('true')", "().__class__.__bases__", "abs(-1)", "x + 1",
     "(lambda: 1)()", "'a' * 3", "True + 1", "[1, 2]", "1 < 2", "open('/etc/passwd')"],
)
def test_calculator_refuses_names_calls_attributes(expr):
    res = calc(expr)
    assert res.error and res.text.startswith("error:")


def test_calculator_huge_values_refused_fast():
    t0 = time.perf_counter()
    for expr in ("9**9**9", "2**100000", "10**10**10", "(10**200)*(10**200)", "1e300*1e300", "9" * 400):
        res = calc(expr)
        assert res.error and ("too large" in res.text or "overflow" in res.text), (expr, res.text)
    assert time.perf_counter() - t0 < 0.5
    assert calc("2**10", max_exponent=8).error  # the bound is configurable
    assert calc("2^3").text == "error: '^' is not a power here: use '**'"


def test_calculator_bad_arguments():
    tool = CalculatorTool()
    res = run(tool.execute("i", {"expr": "1+1"}))
    assert res.error and "expression" in res.text
    assert calc("1 +").error and "syntax" in calc("1 +").text


# ------------------------------------------------------------------------------------ tool YAML
USER_TOOL = textwrap.dedent(
    """
    from hybridflow.agent.tools import Tool, ToolResult

    class EchoTool(Tool):
        async def create(self, instance_id=None, **kwargs):
            instance_id = await super().create(instance_id, **kwargs)
            self.created = kwargs
            return instance_id

        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResult(self.config.get("prefix", "") + parameters["text"], reward=0.5)

    class NotATool:
        pass
    """
)

VERL_YAML = textwrap.dedent(
    """
    tools:
      - class_name: calculator
        config: {type: native, max_exponent: 8}
        tool_schema:
          type: function
          function:
            name: calc
            description: arithmetic
            parameters:
              type: object
              properties: {expression: {type: string, description: an expression}}
              required: [expression]
      - class_name: hybridflow.agent.tools.PythonTool
        config: {type: native, max_output_chars: 100}
      - class_name: "{user}:EchoTool"
        config: {prefix: "> "}
        tool_schema:
          type: function
          function:
            name: echo
            description: repeat the text
            parameters: {type: object, properties: {text: {type: string}}, required: [text]}
    """
)


def write_tool_file(tmp_path):
    p = tmp_path / "my_tools.py"
    p.write_text(USER_TOOL)
    return p


def test_load_verl_shaped_yaml_with_a_user_tool(tmp_path):
    user = write_tool_file(tmp_path)
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(VERL_YAML.replace("{user}", str(user)))
    tools = load_tool_config(cfg)
    assert [t.name for t in tools] == ["calc", "python", "echo"]
    calc_tool, py_tool, echo = tools
    assert isinstance(calc_tool, CalculatorTool) and calc_tool.config.max_exponent == 8
    assert calc_tool.schema["function"]["description"] == "arithmetic"
    assert isinstance(py_tool, PythonTool) and py_tool.config.max_output_chars == 100
    assert py_tool.schema == PythonTool.default_schema  # no tool_schema: the class default
    assert type(echo).__name__ == "EchoTool" and isinstance(echo, Tool)

    async def use():
        async with ToolSession(tools, {"echo": {"create_kwargs": {"seed": 1}}}) as s:
            a = await s.call(ToolCall("echo", {"text": "hi"}))
            b = await s.call(ToolCall("calc", {"expression": "2**9"}))  # refused by max_exponent: 8
            c = await s.call(ToolCall("calc", {"expression": "6*7"}))
            assert set(s.instance_ids) == {"echo", "calc"}  # created lazily, once per trajectory
            assert echo.created == {"seed": 1}
        assert s.instance_ids == {} and echo._instances == {}  # released on exit
        return a, b, c

    a, b, c = run(use())
    assert (a.text, a.reward, a.error) == ("> hi", 0.5, False)
    assert b.error and "exponent" in b.text
    assert c.text == "42"
    # the same class resolves by registry name, dotted path and file path
    assert get_tool_class("calculator") is get_tool_class("hybridflow.agent.tools.CalculatorTool") is CalculatorTool
    assert get_tool_class(f"{user}:EchoTool") is type(echo)


@pytest.mark.parametrize(
    "entry,needle",
    [
        ("- config: {type: native}", "missing class_name"),
        ("- class_name: no_such_tool", "not a registered tool"),
        ("- class_name: no_such_pkg_xyz.Tool", "cannot import module 'no_such_pkg_xyz'"),
        ("- class_name: '{user}:Missing'", "no 'Missing'"),
        ("- class_name: '{user}:NotATool'", "not a subclass"),
        ("- class_name: calculator\n  config: {max_exponnent: 3}", "unknown key(s) ['max_exponnent']"),
        ("- class_name: calculator\n  config: {type: mcp}", "config.type 'mcp' is not supported"),
        ("- class_name: calculator\n  tool_schema: {type: function, function: {description: x}}", "function.name: missing"),
        ("- class_name: '{user}:EchoTool'", "no tool_schema given"),
        ("- class_name: calculator\n  toolschema: {}", "unknown key(s) ['toolschema']"),
        ("- class_name: calculator", "'calculator' is already used by tools[0]"),
    ],
)
def test_bad_tool_entry_names_file_and_entry(tmp_path, entry, needle):
    user = write_tool_file(tmp_path)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tools:\n- class_name: calculator\n" + entry.replace("{user}", str(user)) + "\n")
    with pytest.raises(ToolConfigError) as e:
        load_tool_config(cfg)
    msg = str(e.value)
    assert str(cfg) in msg and "tools[1]" in msg and needle in msg, msg


def test_bad_tool_file_shape(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text("calculator: {}\n")
    with pytest.raises(ToolConfigError, match="top-level 'tools:' list"):
        load_tool_config(cfg)
    with pytest.raises(ToolConfigError, match="not found"):
        load_tool_config(tmp_path / "missing.yaml")


def test_tool_session_never_raises():
    class Boom(Tool):
        default_schema = {"type": "function", "function": {"name": "boom", "parameters": {"type": "object", "properties": {}}}}

        async def execute(self, instance_id, parameters, **kwargs):
            raise RuntimeError("kaput")

    class VerlStyle(Tool):
        default_schema = {"type": "function", "function": {"name": "v"}}

        async def execute(self, instance_id, parameters, **kwargs):
            return "ok", 1.0, {"n": 1}  # verl's (text, reward, metrics)

    async def go():
        s = ToolSession([Boom(), VerlStyle()])
        out = [await s.call(ToolCall("boom", {})), await s.call(ToolCall("nope", {})), await s.call(ToolCall("v", {}))]
        await s.close()
        return out

    boom, nope, v = run(go())
    assert boom.error and "RuntimeError: kaput" in boom.text
    assert nope.error and "unknown tool 'nope'" in nope.text and "boom" in nope.text
    assert (v.text, v.reward, v.metrics, v.error) == ("ok", 1.0, {"n": 1}, False)


# ------------------------------------------------------------------------------------ python tool
@dataclass
class FakeRun:
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = 0
    timed_out: bool = False
    killed_reason: str | None = None


def test_sandbox_result_to_tool_result():
    ok = sandbox_result_to_tool_result(FakeRun(stdout="42\n"), 100)
    assert (ok.text, ok.error) == ("42", False)
    crash = sandbox_result_to_tool_result(FakeRun(stderr="Traceback...\nZeroDivisionError\n", exit_code=1), 100)
    assert crash.error and "ZeroDivisionError" in crash.text and "exit code 1" in crash.text
    slow = sandbox_result_to_tool_result(FakeRun(stdout="partial", exit_code=-9, timed_out=True), 100)
    assert slow.error and "timed out" in slow.text and slow.text.startswith("partial")
    oom = sandbox_result_to_tool_result(FakeRun(exit_code=-9, killed_reason="memory limit"), 100)
    assert oom.error and "killed (memory limit)" in oom.text
    long = sandbox_result_to_tool_result(FakeRun(stdout="a" * 500 + "END"), 100)
    assert len(long.text) <= 100 and long.text.endswith("END") and "truncated" in long.text
    assert sandbox_result_to_tool_result(FakeRun(), 100).text == "(no output)"


def test_python_tool_calls_the_sandbox_lazily(monkeypatch):
    import types

    import hybridflow.agent as agent_pkg

    seen = {}

    def run_python(code, limits):
        seen["code"], seen["limits"] = code, limits
        return FakeRun(stdout="3\n")

    from hybridflow.agent.sandbox import LIMIT_FIELDS, SandboxLimits  # a dataclass: importing it starts nothing

    fake = types.SimpleNamespace(run_python=run_python, LIMIT_FIELDS=LIMIT_FIELDS, SandboxLimits=SandboxLimits)
    monkeypatch.setitem(sys.modules, "hybridflow.agent.sandbox", fake)
    monkeypatch.setattr(agent_pkg, "sandbox", fake, raising=False)
    tool = PythonTool({"limits": {"wall_s": 2}})
    res = run(tool.execute("i", {"code": "print(1+2)"}))
    assert (res.text, res.error) == ("3", False)
    assert seen == {"code": "print(1+2)", "limits": SandboxLimits(wall_s=2)}
    assert run(tool.execute("i", {})).error


def test_python_tool_without_a_sandbox_stops_the_run(monkeypatch):
    import types

    import hybridflow.agent as agent_pkg

    class SandboxUnavailable(RuntimeError):
        pass

    def run_python(code, limits):
        raise SandboxUnavailable("install bubblewrap")

    fake = types.SimpleNamespace(run_python=run_python, SandboxUnavailable=SandboxUnavailable)
    monkeypatch.setitem(sys.modules, "hybridflow.agent.sandbox", fake)
    monkeypatch.setattr(agent_pkg, "sandbox", fake, raising=False)
    # a machine problem is not shown to the model as a tool error: every call would fail
    with pytest.raises(ToolSetupError, match="install bubblewrap"):
        run(ToolSession([PythonTool()]).call(ToolCall("python", {"code": "print(1)"})))


def test_python_tool_in_the_real_sandbox():
    sandbox = pytest.importorskip("hybridflow.agent.sandbox")
    tool = PythonTool({"max_output_chars": 200, "limits": {"wall_s": 3, "cpu_s": 10}})

    async def go(code):
        return await ToolSession([tool]).call(ToolCall("python", {"code": code}))

    try:
        ok = run(go("print(6 * 7)"))
    except ToolSetupError as e:
        pytest.skip(f"no sandbox backend here: {e}")
    assert (ok.text, ok.error) == ("42", False), sandbox
    crash = run(go("1 / 0"))
    assert crash.error and "ZeroDivisionError" in crash.text and "exit code 1" in crash.text
    slow = run(go("while True: pass"))
    assert slow.error and "timed out" in slow.text
    bad = run(ToolSession([tool], {"python": {"execute_kwargs": {"limits": {"wall_s": -1}}}}).call(
        ToolCall("python", {"code": "1"})))  # a per-row override is only seen at call time
    assert bad.error and "bad sandbox limits" in bad.text


@pytest.mark.parametrize("limits, message", [
    ({"wal_s": 3}, r"limits\.wal_s: not a sandbox limit .*did you mean limits\.wall_s\?"),
    ({"wall_s": 0}, r"limits\.wall_s must be a number > 0, got 0"),
    ({"memory_mb": -1}, r"limits\.memory_mb must be a number > 0"),
    ({"cpu_s": "fast"}, r"limits\.cpu_s must be a number > 0, got 'fast'"),
    ({"max_procs": True}, r"limits\.max_procs must be a number > 0"),
])
def test_python_tool_limits_are_checked_when_the_config_loads(tmp_path, limits, message):
    with pytest.raises(ToolConfigError, match=message):
        PythonTool({"limits": limits})
    path = tmp_path / "tools.yaml"  # the same from verl's YAML, before any call
    path.write_text(yaml.safe_dump({"tools": [{"class_name": "python", "config": {"type": "native", "limits": limits}}]}))
    with pytest.raises(ToolConfigError, match=message):
        load_tool_config(path)


def test_tool_output_loses_control_characters_and_counts_them():
    class Noisy(Tool):
        default_schema = function_schema("noisy", "prints escapes", {}, [])

        async def execute(self, instance_id, parameters, **kw):
            return "red \x1b[31mtext\x1b[0m\x00\tcol\r\nnext\x07 \u00e9\x9b"

    res = run(ToolSession([Noisy()]).call(ToolCall("noisy", {})))
    # two ESC, NUL, CR, BEL and the C1 CSI go (6 characters); tab, newline and printable text stay
    assert res.text == "red [31mtext[0m\tcol\nnext \u00e9"
    assert res.metrics["control_chars"] == 6


# ------------------------------------------------------------------------------------ hermes
def test_hermes_parse_one_two_malformed_none():
    fmt = get_format("hermes")
    one = fmt.parse('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>')
    assert one.calls == [ToolCall("calculator", {"expression": "2+3"})] and one.errors == []
    assert one.content == "Let me compute."

    two = fmt.parse('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
                    '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert two.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2})]  # string arguments decoded

    bad = fmt.parse('<tool_call>{"name": "a", "arguments": {x: 1}}</tool_call>'
                    '<tool_call>["a"]</tool_call>'
                    '<tool_call>{"arguments": {}}</tool_call>'
                    '<tool_call>{"name": "ok"}</tool_call>'
                    '<tool_call>{"name": "cut", "argu')
    assert bad.calls == [ToolCall("ok", {})]
    assert len(bad.errors) == 4
    assert "invalid JSON" in bad.errors[0] and "JSON object" in bad.errors[1] and "'name'" in bad.errors[2]
    assert "without </tool_call>" in bad.errors[3]

    none = fmt.parse("The answer is 5.")
    assert none.calls == [] and none.errors == [] and none.content == "The answer is 5."
    assert fmt.tool_message(ToolResult("5"), name="calculator") == {"role": "tool", "content": "5", "name": "calculator"}
    with pytest.raises(ValueError, match="unknown tool-call format"):
        get_format("nope")


# ------------------------------------------------------------------------------------ templates
# A Llama-3-style template: bos once, header markers, content trimmed, tool results as `ipython`.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def qwen_tok():
    from hybridflow.models.tiny import build_char_tokenizer

    return build_char_tokenizer()  # the repo's tiny Qwen2-style template


@pytest.fixture(scope="module")
def llama_tok():
    from hybridflow.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()  # same offline char tokenizer, Llama-3 special tokens + template
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


CONV = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2+3?"}]
ASSISTANT = {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'}
TOOL = {"role": "tool", "content": "5"}


@pytest.mark.parametrize(
    "which,want_delta,want_turn_end",
    [
        ("qwen", "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", "\n"),
        ("llama", "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", ""),
    ],
)
def test_message_delta_ids(request, which, want_delta, want_turn_end):
    tok = request.getfixturevalue(f"{which}_tok")
    delta = message_delta_ids(tok, TOOL)
    assert tok.decode(delta) == want_delta  # the message wrapped in the template's markers (no bos, no system)
    assert tok.decode(turn_end_ids(tok)) == want_turn_end
    user_delta = message_delta_ids(tok, {"role": "user", "content": "higher"}, add_generation_prompt=False)
    assert tok.decode(user_delta).endswith("higher" + ("<|im_end|>\n" if which == "qwen" else "<|eot_id|>"))

    prompt = chat_ids(tok, CONV, True)
    full = chat_ids(tok, [*CONV, ASSISTANT, TOOL], True)
    # (1) the assistant turn as the template renders it, then the delta: exactly the full template.
    templated_turn = chat_ids(tok, [*CONV, ASSISTANT], False)
    assert templated_turn + delta == full
    # (2) the model's own tokens: content + the stop token (eos), as generation returns them.
    model_ids = tok.encode(ASSISTANT["content"], add_special_tokens=False) + [tok.eos_token_id]
    assert prompt + model_ids + message_delta_ids(tok, TOOL, after_eos=True) == full
    # verl's plain delta after the model's eos equals the template only where nothing follows eos:
    # Llama-3 (eot_id ends the turn) yes; Qwen no — it lacks the "\n" after <|im_end|>.
    plain = prompt + model_ids + delta
    assert (plain == full) == (want_turn_end == "")
    if want_turn_end:
        assert tok.decode(plain) == tok.decode(full).replace("<|im_end|>\n<|im_start|>tool", "<|im_end|><|im_start|>tool")


def test_delta_of_several_messages_is_rendered_together(qwen_tok, llama_tok):
    two = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}]
    for tok in (qwen_tok, llama_tok):
        both = message_delta_ids(tok, two)
        full = chat_ids(tok, [*CONV, ASSISTANT, *two], True)
        assert chat_ids(tok, [*CONV, ASSISTANT], False) + both == full


def test_delta_refuses_a_template_that_is_not_append_only(qwen_tok):
    from hybridflow.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    # renders messages newest first: appending a message changes the start of the text
    tok.chat_template = "{% for m in messages|reverse %}{{ m['role'] + ':' + m['content'] + '\n' }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="not append-only"):
        message_delta_ids(tok, TOOL)


def test_tool_schemas_in_the_prompt(qwen_tok):
    from hybridflow.models.tiny import CHAT_TEMPLATE, build_char_tokenizer

    schema = CalculatorTool.default_schema
    # the repo's tiny template ignores `tools=`: the hermes description goes into the system message
    assert not template_supports_tools(qwen_tok)
    text = apply_chat_template_with_tools(qwen_tok, CONV, [schema], tokenize=False)
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n")
    assert '"name": "calculator"' in text and "<tool_call>" in text
    no_system = apply_chat_template_with_tools(qwen_tok, CONV[1:], [schema], tokenize=False)
    assert no_system.startswith("<|im_start|>system\n# Tools\n")
    ids = apply_chat_template_with_tools(qwen_tok, CONV, [schema])
    assert qwen_tok.decode(ids) == text
    assert apply_chat_template_with_tools(qwen_tok, CONV, None, tokenize=False) == qwen_tok.apply_chat_template(
        CONV, add_generation_prompt=True, tokenize=False)

    # a template that renders tools itself gets them through `tools=` (its own wording)
    tok = build_char_tokenizer()
    tok.chat_template = ("{% if tools %}{{ 'TOOLS:' + (tools | map(attribute='function') | map(attribute='name') | join(',')) + '\n' }}"
                         "{% endif %}" + CHAT_TEMPLATE)
    assert template_supports_tools(tok)
    text = apply_chat_template_with_tools(tok, CONV, [schema], tokenize=False)
    assert text.startswith("TOOLS:calculator\n<|im_start|>system\nUse tools.<|im_end|>")


# ------------------------------------------------------------------------------------ guess env
def guess_row(target=37, **extra):
    return {"prompt": [], "extra_info": {"env": "guess", "target": target, **extra}}


def test_guess_env_higher_lower_correct():
    env = make_env_for_row(guess_row(37, lo=1, hi=100))
    assert isinstance(env, GuessNumberEnv)
    first = env.reset(guess_row(37, lo=1, hi=100))
    assert "between 1 and 100" in first
    msg, reward, done = env.step("I guess 50")
    assert msg.startswith("lower") and reward == 0.0 and not done
    msg, reward, done = env.step("Then 25.")
    assert msg.startswith("higher") and not done
    msg, reward, done = env.step("Hmm, 30 was low, so 37")  # the last number is the answer
    assert msg.startswith("correct") and reward == 1.0 and done
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("37")


def test_guess_env_turn_limit_unparseable_and_shaping():
    env = make_env("guess", {"max_turns": 3})
    env.reset(guess_row(5, lo=1, hi=10))
    msg, _, done = env.step("no idea")
    assert "could not find a number" in msg and "between 1 and 10" in msg and not done
    msg, _, done = env.step("99")
    assert "outside 1..10" in msg and not done
    msg, reward, done = env.step("4")
    assert done and reward == 0.0 and "the number was 5" in msg

    shaped = make_env("guess", {"turn_penalty": 0.25})
    shaped.reset(guess_row(5, lo=1, hi=10))
    shaped.step("1")
    shaped.step("2")
    assert shaped.step("5") == ("correct! The number is 5.", 0.5, True)  # 1 - 0.25 * (3 - 1)


def test_env_selection_per_row():
    assert make_env_for_row({"extra_info": {}}) is None
    verl_row = {"extra_info": {"target": 3, "interaction_kwargs": {"name": "guess"}}}
    assert isinstance(make_env_for_row(verl_row), GuessNumberEnv)
    env = make_env_for_row({"extra_info": {"target": 3, "env_kwargs": {"max_turns": 2}}}, default="guess")
    assert env.config.max_turns == 2
    with pytest.raises(ValueError, match="unknown environment"):
        make_env_for_row({"extra_info": {"env": "chess"}})
    with pytest.raises(ValueError, match="unknown option"):
        make_env("guess", {"max_turn": 2})
    with pytest.raises(ValueError, match="no extra_info.target"):
        make_env("guess").reset({"extra_info": {}})
    with pytest.raises(ValueError, match="outside 1..100"):
        make_env("guess").reset({"extra_info": {"target": 500}})

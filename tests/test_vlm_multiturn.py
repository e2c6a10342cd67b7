"""Multi-turn trajectories with images: a render tool's image in the agent loop, the trainer's log-probs over it, and
image_url parts through the OpenAI-compatible endpoint.

Oracles are independent of the code under test: the expected image-token counts and grids from the image sizes by hand
(14-px patches, 2x2 merged: grid (1, h/14, w/14), h*w/784 tokens); the image processor called directly on the decoded
PNG; the processor on the whole conversation rendered by its own chat template; the tokens each backend call returned,
recorded inside the generate function; a plain HF forward of each unpadded sequence with those pixel values (the model
computes its own rope index).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re

import httpx
import pytest
import torch
from PIL import Image, ImageDraw

from hybridflow.agent.format import HermesFormat
from hybridflow.agent.loop import AgentSettings, RequestBatcher, run_trajectories
from hybridflow.agent.openai_server import EndpointSettings, LiveEndpoint
from hybridflow.agent.tools import Tool, ToolResult
from hybridflow.models.tiny import main_make_model
from hybridflow.models.vlm import load_processor
from hybridflow.models.vlm_inputs import ImageRequest, suppressed_token_ids
from hybridflow.protocol import Completion, SamplingParams

RENDER = {"type": "function", "function": {"name": "render", "description": "Draw a canvas of the given size.",
                                           "parameters": {"type": "object", "properties": {"width": {"type": "integer"}, "height": {"type": "integer"}},
                                                          "required": ["width", "height"]}}}
# per row: the canvases its model turns ask for (width, height), then a sampled answer
PLANS = {"A": [(56, 56), (28, 56)], "B": [(28, 28)]}
BUDGET = 256


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForImageTextToText

    out = tmp_path_factory.mktemp("vlm") / "qwen2_vl"
    assert main_make_model([str(out), "--arch", "qwen2_vl"]) == 0
    model = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    return load_processor(out), model, AutoConfig.from_pretrained(str(out))


def _png(width: int, height: int) -> bytes:
    img = Image.new("RGB", (width, height), (255, 255, 255))
    ImageDraw.Draw(img).rectangle([2, 3, width // 2, height - 4], fill=(200, 30, 30))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _call_text(width: int, height: int) -> str:
    return f'<tool_call>\n{{"name": "render", "arguments": {{"width": {width}, "height": {height}}}}}\n</tool_call>'


class Render(Tool):
    default_schema = RENDER

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResult(f"{parameters['width']}x{parameters['height']}", images=[_png(parameters["width"], parameters["height"])])


class Backend:
    """The loop's generate function: a row's planned tool calls come back as scripted completions, its last turn is
    sampled by the HF rollout with the request's images. Records every request and the tokens returned, per session."""

    def __init__(self, tok, rollout):
        self.tok, self.rollout = tok, rollout
        self.requests, self.sampled = [], {}

    def __call__(self, requests):
        out, real = [None] * len(requests), []
        for i, r in enumerate(requests):
            text = self.tok.decode(list(r.prompt_ids))
            plan = PLANS[re.search(r"row (\w)", text).group(1)]
            done = text.count("<|im_start|>tool")
            if done < len(plan):
                ids = self.tok.encode(_call_text(*plan[done]), add_special_tokens=False) + [self.tok.eos_token_id]
                out[i] = Completion(tuple(ids), tuple(-0.01 * (k + 1) for k in range(len(ids))), "stop")
            else:
                real.append(i)
        for i, c in zip(real, self.rollout.generate_requests([requests[i] for i in real]) if real else []):
            out[i] = c
        for r, c in zip(requests, out):
            self.requests.append(r)
            self.sampled.setdefault(r.session, []).append(list(c.token_ids))
        return out


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            out.append((mask[start], start, k))
            start = k
    return out


@pytest.fixture(scope="module")
def trajectories(vlm):
    from hybridflow.rollout.hf_rollout import HFRollout

    processor, model, _ = vlm
    backend = Backend(processor.tokenizer, HFRollout(model, processor.tokenizer, "cpu", continuous=False))
    settings = AgentSettings(max_assistant_turns=4, response_budget=BUDGET, processor=processor)
    rows = [{"raw_prompt": [{"role": "user", "content": f"row {name}: draw, then answer."}]} for name in PLANS]
    params = SamplingParams(max_new_tokens=BUDGET, temperature=1.0, seed=5)
    trajs, _ = asyncio.run(run_trajectories(rows, backend, processor.tokenizer, settings, params, [Render()]))
    return trajs, backend, params


def _oracle_pixels(processor, width: int, height: int) -> dict:
    """The image processor alone on the decoded PNG."""
    enc = processor.image_processor(images=[Image.open(io.BytesIO(_png(width, height))).convert("RGB")], return_tensors="pt")
    return {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}


def test_a_render_tools_image_is_the_processors_tokens_with_mask_0_and_the_model_tokens_are_the_sampled_ones(vlm, trajectories):
    processor, _, config = vlm
    tok = processor.tokenizer
    trajs, backend, _ = trajectories
    for name, traj in zip(PLANS, trajs):
        plan = PLANS[name]
        runs = _runs(traj.response_mask)
        model_runs = [traj.response_ids[a:b] for v, a, b in runs if v == 1]
        tool_runs = [traj.response_ids[a:b] for v, a, b in runs if v == 0]
        # the model's tokens: exactly what each backend call returned for this trajectory, turn by turn
        assert model_runs == backend.sampled[traj.session], name
        assert traj.num_turns == len(plan) + 1 and len(tool_runs) == len(plan), name
        assert backend.sampled[traj.session][-1] != tok.encode(_call_text(*plan[0]), add_special_tokens=False) + [tok.eos_token_id]
        for k, ((w, h), run) in enumerate(zip(plan, tool_runs)):
            # by hand: 14-px patches merged 2x2 -> h/14 * w/14 / 4 image tokens, in one run between vision start and end
            pads = [t for t in run if t == config.image_token_id]
            assert len(pads) == (h // 14) * (w // 14) // 4, (name, k, len(pads))
            s = run.index(config.vision_start_token_id)
            assert run[s + 1 : s + 1 + len(pads)] == pads and run[s + 1 + len(pads)] == config.vision_end_token_id
            # the trajectory keeps the processor's pixels for that image, in order
            end, mm = traj.image_inputs[k]
            want = _oracle_pixels(processor, w, h)
            assert mm["image_grid_thw"].tolist() == [[1, h // 14, w // 14]] == want["image_grid_thw"].tolist()
            assert torch.equal(mm["pixel_values"], want["pixel_values"]), (name, k)
            assert traj.response_mask[end - 1] == 0 and end == [b for v, a, b in runs if v == 0][k]
        # the whole trajectory up to its last tool message is the processor's rendering of the conversation
        conv = [{"role": "system", "content": HermesFormat().system_prompt([RENDER])},
                {"role": "user", "content": f"row {name}: draw, then answer."}]
        for (w, h), call in zip(plan, model_runs):
            conv += [{"role": "assistant", "content": tok.decode(call[:-1])},
                     {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": f"{w}x{h}"}]}]
        text = processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        whole = processor(text=[text], images=[Image.open(io.BytesIO(_png(w, h))).convert("RGB") for w, h in plan], return_tensors="pt")
        last_tool_end = [b for v, a, b in runs if v == 0][-1]
        assert whole["input_ids"][0].tolist() == traj.prompt_ids + traj.response_ids[:last_tool_end], name
        assert torch.equal(traj.multi_modal_inputs["pixel_values"], whole["pixel_values"])
        # every request after an image carried all of the trajectory's images so far, as an ImageRequest
        mine = [r for r in backend.requests if r.session == traj.session]
        assert [type(r) for r in mine] == [type(mine[0])] + [ImageRequest] * len(plan)
        for k, r in enumerate(mine[1:], start=1):
            assert r.multi_modal_inputs["image_grid_thw"].tolist() == [[1, h // 14, w // 14] for w, h in plan[:k]]
        # the backend's log-probs on model tokens, 0 on the tool's
        assert all(lp == 0.0 for lp, m in zip(traj.log_probs, traj.response_mask) if m == 0)


def test_the_trainers_log_probs_over_a_trajectory_with_images_equal_a_plain_hf_forward(vlm, trajectories):
    """The trajectories as the trainer's batch (their images under multi_modal_inputs, M-RoPE position ids): the trainer's
    log-prob pass (engine/model.py, what the actor worker runs per micro-batch) equals a plain HF forward of each unpadded
    sequence with the image processor's own pixel values; the HF rollout's log-probs of its sampled turn agree (it
    generated with the images), and without the images' pixels (other ones) the log-probs differ."""
    from hybridflow.engine.model import response_logprobs
    from hybridflow.service.agent_rollout import trajectories_to_batch

    processor, model, config = vlm
    trajs, _, params = trajectories
    batch = trajectories_to_batch(trajs, processor.tokenizer.pad_token_id, params, model_config=config)
    assert batch["position_ids"].shape == (2, 3, batch["input_ids"].shape[1])
    with torch.no_grad():
        ours, _ = response_logprobs(model, batch)  # [b, R]
        for r, (name, traj) in enumerate(zip(PLANS, trajs)):
            oracle = [_oracle_pixels(processor, w, h) for w, h in PLANS[name]]
            ids = torch.tensor([traj.prompt_ids + traj.response_ids])
            n, P = len(traj.response_ids), len(traj.prompt_ids)

            def logp(pixels, suppress=()):
                logits = model(input_ids=ids, mm_token_type_ids=(ids == config.image_token_id).long(),
                               pixel_values=torch.cat([o["pixel_values"] for o in pixels]),
                               image_grid_thw=torch.cat([o["image_grid_thw"] for o in pixels])).logits
                z = logits[0, P - 1 : -1].double()  # [n, V]
                z[:, list(suppress)] = float("-inf")  # the tokens the rollout never samples, left out of the softmax
                return torch.log_softmax(z, -1).gather(-1, ids[0, P:, None])[:, 0].float()  # [n]

            want = logp(oracle)
            assert torch.equal(batch["responses"][r, :n], ids[0, P:]) and int(batch["attention_mask"][r].sum()) == P + n
            # fp32 forwards of a 0.19M-parameter model, padded against unpadded: ~1e-6 apart
            torch.testing.assert_close(ours[r, :n], want, rtol=0, atol=2e-5, msg=name)
            sampled = torch.arange(n) >= _last_turn_start(traj)  # the HF-sampled last turn
            # the rollout's log-probs under the temperature alone, renormalised without the four vision tokens it never samples
            # (the trainer's TrainEngine leaves them out too: engine/model.py): the sampled turn was generated with the same images
            masked = logp(oracle, suppressed_token_ids(config))
            torch.testing.assert_close(torch.tensor(traj.untruncated_log_probs)[sampled], masked[sampled], rtol=0, atol=1e-5, msg=name)
            other = logp([{**o, "pixel_values": torch.flip(o["pixel_values"], dims=[0])} for o in oracle])
            assert (other - want)[sampled].abs().max() > 1e-4, name  # the pixels reach the log-probs


def _last_turn_start(traj) -> int:
    """Where the trajectory's last model turn (the HF-sampled one) starts in its response."""
    return [a for v, a, b in _runs(traj.response_mask) if v == 1][-1]


# ------------------------------------------------------------------------------------------ endpoint
def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chat_body(tool_content, prefix: list | None = None) -> dict:
    call = {"id": "call_1", "type": "function", "function": {"name": "render", "arguments": json.dumps({"width": 56, "height": 28})}}
    msgs = prefix if prefix is not None else [{"role": "user", "content": "row A: draw"},
                                               {"role": "assistant", "content": None, "tool_calls": [call]}]
    return {"model": "tiny", "messages": [*msgs, {"role": "tool", "tool_call_id": "call_1", "content": tool_content}], "tools": [RENDER]}


def test_the_endpoint_records_a_tool_messages_data_url_image_and_refuses_what_it_cannot_take(vlm, tiny_model_dir):
    from transformers import AutoTokenizer

    from hybridflow.rollout.hf_rollout import HFRollout

    processor, model, config = vlm
    tok = processor.tokenizer
    rollout = HFRollout(model, tok, "cpu", continuous=False)
    seen: list = []

    def generate(requests):
        seen.extend(requests)
        out = []
        for r in requests:
            if isinstance(r, ImageRequest):
                out += rollout.generate_requests([r])
            else:  # the first turn: the tool call the agent then answers
                ids = tok.encode(_call_text(56, 28), add_special_tokens=False) + [tok.eos_token_id]
                out.append(Completion(tuple(ids), (-0.5,) * len(ids), "stop"))
        return out

    png = _png(56, 28)
    bad = {
        "remote URL": {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        "bad base64": {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not base64@@"}},
        "not an image": {"type": "image_url", "image_url": {"url": _data_url(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\n")}},
        "no url": {"type": "image_url", "image_url": "nope"},
    }

    async def body(ep, batcher):
        s = ep.open_session()
        headers = {"Authorization": f"Bearer {s.key}"}
        url = ep.url(s) + "/chat/completions"
        async with httpx.AsyncClient(timeout=60) as http:
            first = (await http.post(url, headers=headers, json={"model": "tiny", "messages": [{"role": "user", "content": "row A: draw"}],
                                                                 "tools": [RENDER]})).json()
            call = first["choices"][0]["message"]
            prefix = [{"role": "user", "content": "row A: draw"}, {"role": "assistant", "content": call["content"], "tool_calls": call["tool_calls"]}]
            errors = {}
            state = (s.requests, batcher.calls)
            for name, part in bad.items():
                r = await http.post(url, headers=headers, json=_chat_body([part, {"type": "text", "text": "56x28"}], prefix))
                errors[name] = (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"])
            r = await http.post(url, headers=headers, json=_chat_body("see <|image_pad|> here", prefix))
            errors["image token in text"] = (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"])
            r = await http.post(ep.url(s) + "/completions", headers=headers, json={"model": "tiny", "prompt": "a <|image_pad|> b"})
            errors["image token in a completions prompt"] = (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"])
            unchanged = state == (s.requests, batcher.calls)
            good = (await http.post(url, headers=headers, json=_chat_body([{"type": "image_url", "image_url": {"url": _data_url(png)}},
                                                                           {"type": "text", "text": "56x28"}], prefix))).json()
        return s, first, errors, unchanged, good

    batcher_params = SamplingParams(max_new_tokens=120, temperature=1.0, seed=2)

    async def serve(tokenizer, gen, proc, fn):
        batcher = RequestBatcher(gen, batcher_params)
        ep = LiveEndpoint(EndpointSettings("tiny", 120 + 60, 1000, sampling="run"), tokenizer, batcher, proc)
        async with ep.serve():
            return await fn(ep, batcher)

    session, first, errors, unchanged, good = asyncio.run(serve(tok, generate, processor, body))
    field = "messages[2].content[0].image_url"
    assert errors["remote URL"][:2] == (400, field) and "not fetched" in errors["remote URL"][2] and "data URL" in errors["remote URL"][2]
    assert errors["bad base64"][:2] == (400, field) and "base64" in errors["bad base64"][2]
    assert errors["not an image"][:2] == (400, field) and "cannot decode" in errors["not an image"][2]
    assert errors["no url"][:2] == (400, field)
    assert errors["image token in text"][:2] == (400, "messages")
    assert errors["image token in a completions prompt"][:2] == (400, "prompt")
    assert unchanged  # a refused request records nothing and generates nothing
    assert session.mismatches == 0 and session.requests == 2 and len(session.segments) == 1  # the image request continued the recorded tokens
    # the accepted request: generated with the image, recorded with its placeholders (mask 0) and its pixels
    traj = session.trajectory()
    assert [type(r) for r in seen] == [type(seen[0]), ImageRequest] and not isinstance(seen[0], ImageRequest)
    want = _oracle_pixels(processor, 56, 28)
    assert torch.equal(seen[1].multi_modal_inputs["pixel_values"], want["pixel_values"])
    assert len(traj.image_inputs) == 1 and torch.equal(traj.multi_modal_inputs["pixel_values"], want["pixel_values"])
    assert traj.multi_modal_inputs["image_grid_thw"].tolist() == [[1, 2, 4]]
    first_ids, second_ids = first["choices"][0]["token_ids"], good["choices"][0]["token_ids"]
    runs = _runs(traj.response_mask)
    assert [traj.response_ids[a:b] for v, a, b in runs if v == 1] == [first_ids, second_ids]  # the model's tokens as sampled
    delta = [traj.response_ids[a:b] for v, a, b in runs if v == 0][0]
    assert delta.count(config.image_token_id) == (28 // 14) * (56 // 14) // 4  # 2 image tokens for 56x28 px
    assert good["prompt_token_ids"] == traj.prompt_ids + traj.response_ids[: runs[-1][1]]
    # the same image to a text-only model: 400 naming the field, nothing generated
    text_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    calls = []

    async def text_body(ep, batcher):
        s = ep.open_session()
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(ep.url(s) + "/chat/completions", headers={"Authorization": f"Bearer {s.key}"},
                                json={"model": "tiny", "messages": [{"role": "user", "content": [
                                    {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": _data_url(png)}}]}]})
        return r.status_code, r.json()["error"]

    status, err = asyncio.run(serve(text_tok, lambda rs: calls.extend(rs) or [], None, text_body))
    assert status == 400 and err["param"] == "messages[0].content[1].image_url" and "text-only" in err["message"] and not calls


def test_images_are_refused_where_they_cannot_go(vlm, tiny_model_dir):
    """The continuous-batching scheduler refuses an image request (naming the key); a text-only policy's agent loop
    refuses a tool's image; a tool's undecodable image becomes an error the model reads."""
    from transformers import AutoTokenizer

    from hybridflow.agent.loop import ToolAgentLoop
    from hybridflow.rollout.hf_rollout import HFRollout

    processor, model, _ = vlm
    mm = _oracle_pixels(processor, 28, 28)
    req = ImageRequest(tuple(processor.tokenizer.encode("<|vision_start|><|image_pad|><|vision_end|>x", add_special_tokens=False)),
                       SamplingParams(max_new_tokens=2), None, mm)
    with pytest.raises(RuntimeError, match="continuous_batching=false"):
        HFRollout(model, processor.tokenizer, "cpu", continuous=True).generate_requests([req])
    text_loop = ToolAgentLoop(AutoTokenizer.from_pretrained(tiny_model_dir), AgentSettings())
    with pytest.raises(ValueError, match="text-only"):
        text_loop._shown(ToolResult("x", images=[_png(28, 28)]), "render")
    shown = ToolAgentLoop(processor.tokenizer, AgentSettings(processor=processor))._shown(ToolResult("x", images=[b"GIF89a broken"]), "render")
    assert shown.error and "cannot be shown" in shown.text and not shown.images

"""`hybridflow mismatch RUN_DIR [--step N]`: where the rollout and the trainer part ways, layer by layer.

The mismatch doctor replays a batch of the run's prompts at a checkpoint through the two
computations the run compares in `rollout/logprob_diff_*`, with a forward hook on every probe
(the embedding, each decoder layer, the final norm, the LM head):

- the rollout side: the HF backend as the run configures it (`HFRollout`: batched, left-padded,
  KV-cached `generate`; or the exact sampler with actor_rollout_ref.rollout.exact) on a model in
  the generation dtype holding the checkpoint's weights cast as the weight sync casts them;
- the trainer side: the trainer's own forward (`engine/model.py`, the padded or exact layout) on a
  model whose parameters are in the training compute dtype (FSDP2's mixed precision casts the
  parameters, not the buffers), over the same prompts and the tokens the rollout sampled.

For every response token, each probe's activation at the position that predicts it is taken from
the rollout call that produced the token and from the trainer's pass; per probe the max and mean
|difference| over the batch's response tokens is printed, then the log-prob difference. The layer
named is where the difference starts: the first probe whose max difference is over `jump` (10)
times the largest before it and over rounding level (4 x the generation dtype's epsilon x the probe's
largest activation); a difference that grows gradually from the first layer on, at rounding level,
is kernels summing in another order, not a layer. In the exact mode both sides compute the same
numbers, so the first non-zero difference is named.

An MoE model's table has one more column: per decoder layer, the share of the replayed tokens
(prompt and response) whose top-k expert set differs between the two sides (the rollout's record,
`models/routing.py`, against the trainer's own routers), where routing replay would step in.

A vLLM run (where vLLM is installed) replays through vLLM itself (`diagnose_vllm`): the engine in
this process on an HF checkpoint of the cast weights, one request at a time (the prefix cache reset
before each, so its prefill computes every prompt token), with the same hooks on vLLM's modules: a
decoder layer's output is its (hidden, residual) pair summed (vLLM fuses the residual add into the
next norm), the final norm's its normalised output, the head's the logits processor's. vLLM runs
its own kernels (paged attention, fused norm + residual, its own GEMMs and sampler), so its
difference is not zero: the table shows it per layer. Without vLLM the run is replayed through the
HF backend and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.models.moe import routers
from hybridflow.models.routing import RouteRecorder, has_routers, routing_agreement
from hybridflow.protocol import Completion, Request, SamplingParams


@dataclass(frozen=True)
class ProbeDiff:
    name: str  # module path in the HF model, e.g. "model.layers.3"
    max: float
    mean: float
    scale: float  # max |activation| (the trainer's): what a rounding-level difference is measured against


@dataclass(frozen=True)
class Report:
    probes: list[ProbeDiff]
    logprob_max: float
    logprob_mean: float
    named: str | None  # where the difference starts (None: no difference at all)
    # MoE: per decoder layer with a router, the share of tokens whose top-k expert set differs between the sides
    routing_differs: dict[str, float] | None = None

    def table(self) -> str:
        moe = self.routing_differs is not None
        lines = [f"{'probe':<28} {'max |diff|':>12} {'mean |diff|':>12}" + (f" {'experts differ':>15}" if moe else "")]
        for p in self.probes:
            mark = "   <- the difference starts here" if p.name == self.named else ""
            share = f" {self.routing_differs[p.name]:>15.3f}" if moe and p.name in self.routing_differs else (f" {'':>15}" if moe else "")
            lines.append(f"{p.name:<28} {p.max:>12.3g} {p.mean:>12.3g}{share}{mark}")
        lines.append(f"{'log-prob of the sampled token':<28} {self.logprob_max:>12.3g} {self.logprob_mean:>12.3g}")
        if self.named:
            lines.append(f"first layer that differs: {self.named}")
        elif any(p.max > 0 for p in self.probes):
            lines.append("no layer stands out: the differences stay at rounding level (kernels that sum in another order)")
        else:
            lines.append("no probe differs: the two sides agree bit for bit")
        if moe:
            lines.append("experts differ: the share of the replayed tokens (prompt and response) whose top-k experts differ between the sides")
        return "\n".join(lines)


def probes(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) in forward order: the embedding, every decoder layer, the final norm, the head."""
    from hybridflow.parallel.fsdp import decoder_layers

    names = {m: n for n, m in model.named_modules()}
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    out = [base.embed_tokens, *decoder_layers(model), base.norm, model.get_output_embeddings()]
    return [(names[m], m) for m in out]


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Every probe's output of every forward call, in call order: {name: [tensor [b, T, H or V]]}."""
    calls: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in probes(model):
        def hook(_m, _inp, out, name=name):
            calls.setdefault(name, []).append((out[0] if isinstance(out, tuple) else out).detach().float().clone())
        handles.append(module.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _rollout_side(gen_model: nn.Module, tokenizer, requests: list[Request], exact: bool
                  ) -> tuple[list[Completion], dict[str, list[list[torch.Tensor]]], list[torch.Tensor] | None]:
    """The backend's completions, per probe per request the activation [H] that predicted each token,
    and for an MoE model per request the experts each position ran through ([p + n, L, k], -1 = none)."""
    from hybridflow.rollout.hf_rollout import HFRollout

    is_moe = has_routers(gen_model)
    moe = RouteRecorder(gen_model) if exact and is_moe else None  # exact: the verify passes' routing, recorded here
    backend = HFRollout(copy.deepcopy(gen_model) if exact else gen_model, tokenizer, "cpu", exact=exact, record_routes=is_moe and not exact)
    if exact:  # the copy drafts (rollout/exact_sampler.py), gen_model decides: only its verify passes are recorded
        backend.exact_model = gen_model
    try:
        with recording(gen_model) as calls, moe.capture() if moe is not None else contextlib.nullcontext([]) as forwards:
            completions = backend.generate_requests(requests)
    finally:  # the caller's model keeps no hook of ours
        for recorder in (moe, backend.recorder):
            if recorder is not None:
                recorder.remove()
    routes = [c.routed_experts for c in completions] if backend.recorder is not None else None  # [p + n, L, k] each
    if moe is not None:  # the last verify pass of each request; its last token is never fed back (as the generate record has it)
        routes = [_unfed_last(forwards[k][: len(r.prompt_ids) + len(c.token_ids)]) for r, c, k in
                  zip(requests, completions, backend.exact_stats["last_pass"])]
    head = probes(gen_model)[-1][0]
    out: dict[str, list[list[torch.Tensor]]] = {}
    for name, outs in calls.items():
        rows: list[list[torch.Tensor]] = []
        if exact:  # per request: its last verify pass (its rows before the end read only the kept tokens)
            for r, c, k in zip(requests, completions, backend.exact_stats["last_pass"]):
                p = len(r.prompt_ids)
                # hidden states hold every position (token t's predictor: p - 1 + t); the head the R + 1 last (row t)
                pos = (lambda t: t) if name == head else (lambda t, p=p: p - 1 + t)
                rows.append([outs[k][0, pos(t)] for t in range(len(c.token_ids))])
        else:  # one generate: the prefill (its last position predicts token 0), then a call per token
            for b, c in enumerate(completions):
                rows.append([outs[t][b, -1] for t in range(len(c.token_ids))])
        out[name] = rows
    return completions, out, routes


def _unfed_last(routes: torch.Tensor) -> torch.Tensor:
    """routes [n, L, k] with the last position's ids set to -1 (not recorded)."""
    routes = routes.clone()
    routes[-1] = -1
    return routes


def _trainer_side(train_model: nn.Module, pad_id: int, requests: list[Request], completions: list[Completion], R: int,
                  exact: bool) -> tuple[dict[str, list[list[torch.Tensor]]], list[torch.Tensor] | None]:
    """Per probe per request the trainer's activation [H] at each response token's predicting position,
    and for an MoE model per request the experts its own routers chose ([p + n, L, k])."""
    head = probes(train_model)[-1][0]
    from hybridflow.engine.model import response_logits
    from hybridflow.models.exact import exact_row_logits
    from hybridflow.rollout.base import rollout_batch

    P = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(requests), P), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    responses = torch.full((len(requests), R), pad_id, dtype=torch.long)
    for i, (r, c) in enumerate(zip(requests, completions)):
        ids[i, P - len(r.prompt_ids):], mask[i, P - len(r.prompt_ids):] = torch.tensor(r.prompt_ids), 1
        responses[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
    lengths = torch.tensor([len(c.token_ids) for c in completions])
    batch = rollout_batch(ids, mask, responses, torch.zeros(responses.shape), lengths, requests[0].params)
    T = requests[0].params.effective_temperature
    out: dict[str, list[list[torch.Tensor]]] = {}
    moe = RouteRecorder.attach(train_model)
    try:
        with torch.no_grad(), recording(train_model) as calls, moe.capture() if moe is not None else contextlib.nullcontext([]) as forwards:
            if exact:
                for r, resp in zip(requests, responses):
                    exact_row_logits(train_model, torch.tensor(r.prompt_ids), resp, T)
            else:
                response_logits(train_model, batch, T)
    finally:
        if moe is not None:
            moe.remove()
    routes = None
    if moe is not None:  # per request [p + n, L, k]: an exact pass per row, or rows of the padded [b, P + R] forward
        spans = [(len(r.prompt_ids), len(c.token_ids)) for r, c in zip(requests, completions)]
        routes = ([f[: p + n] for f, (p, n) in zip(forwards, spans)] if exact else
                  [forwards[0].view(len(requests), P + R, *forwards[0].shape[1:])[i, P - p : P + n] for i, (p, n) in enumerate(spans)])
    for name, outs in calls.items():
        rows = []
        for i, (r, c) in enumerate(zip(requests, completions)):
            o, b = (outs[i], 0) if exact else (outs[0], i)
            start = (len(r.prompt_ids) - 1) if exact else P - 1  # the position predicting token 0
            if name == head:  # the head keeps the R + 1 last positions: token t's is row t
                rows.append([o[b, t] for t in range(len(c.token_ids))])
            else:
                rows.append([o[b, start + t] for t in range(len(c.token_ids))])
        out[name] = rows
    return out, routes


def diagnose(train_model: nn.Module, gen_model: nn.Module, tokenizer, prompts: list[list[int]], params: SamplingParams,
             exact: bool = False, jump: float = 10.0) -> Report:
    """Replay `prompts` through both sides (module docstring) and compare them probe by probe."""
    requests = [Request(p, params) for p in prompts]
    completions, gen, gen_routes = _rollout_side(gen_model, tokenizer, requests, exact)
    train, train_routes = _trainer_side(train_model, tokenizer.pad_token_id, requests, completions, params.max_new_tokens, exact)
    eps = torch.finfo(next(gen_model.parameters()).dtype).eps
    report = _compare([n for n, _ in probes(gen_model)], gen, train, completions, params, 0.0 if exact else eps, jump)
    if gen_routes is None or train_routes is None:
        return report
    differs = routing_agreement(torch.cat(gen_routes)[None], torch.cat(train_routes)[None], torch.ones(1, sum(len(r) for r in gen_routes)))
    return dataclasses.replace(report, routing_differs=dict(zip(_router_layers(gen_model), differs)))


def _router_layers(model: nn.Module) -> list[str]:
    """The probe name (decoder layer) of each router of `model`, in router order."""
    names = {m: n for n, m in model.named_modules()}
    layers = [n for n, _ in probes(model)]
    return [max((n for n in layers if names[r].startswith(n + ".")), key=len) for r in routers(model)]


def _vllm_probes(model: nn.Module, names: list[str]) -> list[tuple[str, nn.Module, object]]:
    """vLLM's modules under the HF probe names `names` (embedding, layers, norm, head), each with
    what turns its output into the HF module's: a layer's (hidden, residual) summed, the norm's
    normalised output, the logits processor's logits for the head."""
    base = model.model
    mods = [base.embed_tokens, *base.layers, base.norm, model.logits_processor]
    if len(mods) != len(names):
        raise ValueError(f"vLLM's model has {len(mods)} probes, the HF model {len(names)}")
    same = lambda out: out  # noqa: E731
    layer = lambda out: out[0] + out[1] if isinstance(out, tuple) and out[1] is not None else (out[0] if isinstance(out, tuple) else out)  # noqa: E731
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    return [(names[0], mods[0], same), *((n, m, layer) for n, m in zip(names[1:-2], mods[1:-2])), (names[-2], mods[-2], first), (names[-1], mods[-1], same)]


def _vllm_side(backend, names: list[str], vocab: int, requests: list[Request]) -> tuple[list[Completion], dict[str, list[list[torch.Tensor]]]]:
    """`backend` (a `VLLMRollout`, in this process) generating one request at a time, and per probe
    per request the activation [H] (the head: logits [V]) that predicted each token: the prefill's
    last row for token 0, decode step t's row for token t (later calls, e.g. a scoring pass, unused)."""
    (model,) = backend.llm.collective_rpc(lambda worker: worker.model_runner.model)
    calls: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module, fix in _vllm_probes(model, names):
        def hook(_m, _inp, out, name=name, fix=fix):
            calls.setdefault(name, []).append(fix(out).detach().float().clone())
        handles.append(module.register_forward_hook(hook))
    completions, out = [], {n: [] for n in names}
    try:
        for r in requests:
            backend.llm.reset_prefix_cache()  # the prefill computes the whole prompt, not a cached prefix
            calls.clear()
            (c,) = backend.generate_requests([r])
            completions.append(c)
            p = len(r.prompt_ids)
            for name in names:
                outs = calls[name]
                if name == names[-1]:  # the logits of the sampled positions only: row 0 of call t (vocab padded per partition)
                    out[name].append([outs[t][0, :vocab] for t in range(len(c.token_ids))])
                else:  # the prefill's row p - 1 predicts token 0; decode call t's row 0 token t
                    out[name].append([outs[0][p - 1] if t == 0 else outs[t][0] for t in range(len(c.token_ids))])
    finally:
        for h in handles:
            h.remove()
    return completions, out


def vllm_backend(gen_model: nn.Module, tokenizer, max_model_len: int = 512):
    """A `VLLMRollout` in this process serving `gen_model`'s architecture in its dtype (its weights
    saved as an HF checkpoint to start from). Build one per process and pass it to every
    `diagnose_vllm`: vLLM's parallel state is process-global, and an engine collected after a
    newer one started tears the newer one's down."""
    import gc
    import tempfile

    from hybridflow.rollout.vllm_rollout import VLLMRollout

    gc.collect()  # an unreachable engine of this process shuts down now, not after ours has started
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[next(gen_model.parameters()).dtype]
    with tempfile.TemporaryDirectory(prefix="hybridflow_mismatch_") as d:
        gen_model.save_pretrained(d)
        tokenizer.save_pretrained(d)
        return VLLMRollout(d, dtype, max_model_len, 0, "cpu", 0.5, 1, tokenizer=tokenizer)


def diagnose_vllm(train_model: nn.Module, gen_model: nn.Module, tokenizer, prompts: list[list[int]], params: SamplingParams,
                  jump: float = 10.0, max_model_len: int = 512, backend=None) -> Report:
    """The doctor against vLLM: `gen_model`'s weights (the generation dtype, cast as the sync casts
    them) served by `backend` (a `vllm_backend` of the same architecture and dtype; None: one is
    built), loaded into it first, compared with the trainer's padded forward probe by probe
    (module docstring)."""
    names = [n for n, _ in probes(gen_model)]
    dtype = next(gen_model.parameters()).dtype
    if backend is None:
        backend = vllm_backend(gen_model, tokenizer, max_model_len)
    else:  # what this call compares: gen_model's weights, whatever the engine held before
        backend.load_weights((n, p.detach()) for n, p in gen_model.named_parameters())
    requests = [Request(p, params) for p in prompts]
    completions, gen = _vllm_side(backend, names, gen_model.config.vocab_size, requests)
    train, _ = _trainer_side(train_model, tokenizer.pad_token_id, requests, completions, params.max_new_tokens, False)
    return _compare(names, gen, train, completions, params, torch.finfo(dtype).eps, jump)


def _compare(names: list[str], gen: dict, train: dict, completions: list[Completion], params: SamplingParams, eps: float, jump: float) -> Report:
    """Per probe max / mean |rollout - trainer| over every response token, the log-prob difference,
    and the probe where the difference starts (`_named`)."""
    diffs = []
    for name in names:
        d = torch.stack([(a - b).abs().max() for ra, rb in zip(gen[name], train[name]) for a, b in zip(ra, rb)])
        m = torch.cat([(a - b).abs().flatten() for ra, rb in zip(gen[name], train[name]) for a, b in zip(ra, rb)])
        scale = max(float(a.abs().max()) for rows in train[name] for a in rows)
        diffs.append(ProbeDiff(name, float(d.max()), float(m.mean()), scale))
    head = diffs[-1].name
    lp = []
    for c, rows_g, rows_t in zip(completions, gen[head], train[head]):
        toks = torch.tensor(c.token_ids)
        T = params.effective_temperature
        lg = logprobs_from_logits(torch.stack(rows_g)[None] / T, toks[None])[0]
        lt = logprobs_from_logits(torch.stack(rows_t)[None] / T, toks[None])[0]
        lp.append((lg - lt).abs())
    lp_all = torch.cat(lp)
    return Report(diffs, float(lp_all.max()), float(lp_all.mean()), _named(diffs, jump, eps))


def _named(diffs: list[ProbeDiff], jump: float, eps: float) -> str | None:
    """The first probe over `jump` x every earlier one and over rounding level (4 x eps x its largest
    activation; the exact mode's eps is 0: any difference is one)."""
    largest = 0.0
    for d in diffs:
        if d.max > jump * largest and d.max > 4 * eps * d.scale:
            return d.name
        largest = max(largest, d.max)
    return None


# ---------------------------------------------------------------------- the command
def _models(run_dir: str, step: int | None):
    """(config, tokenizer, train model, generation model) of the run's checkpoint."""
    from transformers import AutoTokenizer

    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.models.hf import load_hf_model
    from hybridflow.run_plan import resolve
    from hybridflow.trainer import checkpoints
    from hybridflow.utils.export import load_actor_weights

    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_path):
        raise SystemExit(f"error: {cfg_path} not found: RUN_DIR is a run's trainer.default_local_dir")
    cfg = load_config(cfg_path, schema=HybridFlowConfig)
    plan = resolve(cfg)
    if step is None:
        latest = os.path.join(run_dir, checkpoints.LATEST)
        if not os.path.isfile(latest):
            raise SystemExit(f"error: no checkpoint in {run_dir} (trainer.save_freq): pass --step N of a global_step_N directory")
        step = int(open(latest).read().strip())
    actor_dir = os.path.join(run_dir, f"global_step_{step}", "actor")
    if not os.path.isdir(actor_dir):
        raise SystemExit(f"error: {actor_dir} not found: --step names a global_step_<N> directory of the run")
    mcfg = plan.actor.model
    if mcfg.lora_rank > 0:
        raise SystemExit("error: the doctor replays full-weight checkpoints; merge the LoRA run first (hybridflow export --merge)")
    weights = load_hf_model(mcfg, "cpu")  # fp32 master weights, as the trainer holds them
    load_actor_weights(actor_dir, weights)
    train = copy.deepcopy(weights).eval()
    mp = plan.actor.actor.fsdp_config.mixed_precision
    if mp:  # FSDP2's mixed precision: the parameters in the compute dtype, the buffers as they are
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mp]
        for p in train.parameters():
            p.data = p.data.to(dtype)
    gen = load_hf_model(mcfg, "cpu", dtype=plan.rollout.generation_dtype).eval()
    trained = dict(weights.named_parameters())
    with torch.no_grad():  # what the weight sync writes: the trained weights cast to the generation dtype
        for name, p in gen.named_parameters():
            p.copy_(trained[name])
    return cfg, plan, AutoTokenizer.from_pretrained(mcfg.tokenizer_source()), train, gen, step


def main_mismatch(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hybridflow mismatch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="the run's trainer.default_local_dir (config.yaml and global_step_<N>/)")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint to replay (default: the latest)")
    ap.add_argument("--rows", type=int, default=8, help="prompts replayed (the first of the run's training files)")
    ap.add_argument("--jump", type=float, default=10.0, help="a probe names the divergence when its max diff is over this many "
                                                          "times every earlier probe's")
    a = ap.parse_args(argv)
    from hybridflow.data.dataset import RLDataset, collate_rl
    from hybridflow.rollout.base import batch_requests

    cfg, plan, tok, train, gen, step = _models(a.run_dir, a.step)
    d = cfg.data
    ds = RLDataset(d.train_files, tok, d.max_prompt_length, d.prompt_key, d.filter_overlong_prompts, d.truncation)
    batch = collate_rl([ds[i] for i in range(min(a.rows, len(ds)))], tok.pad_token_id, d.max_prompt_length, d.prompt_padding)
    params = plan.rollout.sampling_params(seed=step)
    prompts = [list(r.prompt_ids) for r in batch_requests(batch, params)]
    r = plan.rollout.rollout
    from hybridflow.rollout.vllm_rollout import vllm_available

    if r.name == "vllm" and vllm_available():
        report = diagnose_vllm(train, gen, tok, prompts, params, a.jump, plan.rollout.max_model_len)
        how = "vLLM"
    else:
        if r.name != "hf":
            print(f"note: the run generates with {r.name}, not installed here; the doctor replays the HF backend instead")
        report = diagnose(train, gen, tok, prompts, params, exact=r.exact, jump=a.jump)
        how = "exact" if r.exact else "KV-cached generate"
    print(f"{a.run_dir} step {step}: {len(prompts)} prompts, rollout ({plan.rollout.generation_dtype}, {how}) vs trainer")
    print(report.table())
    return 0

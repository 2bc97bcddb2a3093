"""Turn logits into next tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from lightinfer.kernels import cpu_native
from lightinfer.sampling_params import SamplingParams

INVALID_TOKEN = -1  # the sampler's answer for a row of logits with no finite maximum (see Sampler.__call__)


@dataclass
class SamplingRow:
    """What the sampler needs about one row of logits.

    Attributes:
        params: the request's settings.
        prompt_token_ids / output_token_ids: for the penalties.
        generator: the completion's own generator when the request has a seed, else None
            (the engine's shared generator is used).
        suppress_token_ids: ids banned for this step (EOS / stop tokens before ``min_tokens``).
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    suppress_token_ids: tuple[int, ...] = ()


def has_penalties(params: SamplingParams) -> bool:
    """Whether any repetition / presence / frequency penalty is active."""
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Repetition (CTRL, Keskar et al. 2019; over prompt and output), presence and frequency
    (OpenAI; over the output) penalties on one row ``[vocab]`` (fp32), in place."""
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long,
                            device=logits.device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def adjusted_logits(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``raw`` (fp32 ``[len(rows), vocab]``) with each row's penalties applied and its banned ids at ``-inf``: a
    copy where any row has them, else ``raw`` itself."""
    adjust = [i for i, row in enumerate(rows) if row.suppress_token_ids or has_penalties(row.params)]
    if not adjust:
        return raw
    x = raw.clone()
    for i in adjust:
        apply_penalties(x[i], rows[i])  # in place, on the row's view
        if rows[i].suppress_token_ids:
            x[i, list(rows[i].suppress_token_ids)] = float("-inf")
    return x


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p (nucleus, Holtzman et al. 2020) and min-p on one row."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def filter_logits_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """:func:`filter_logits` for all rows at once: ``[R, vocab]`` fp32 in, the same rows out with the
    temperature applied and the dropped tokens at ``-inf``. One descending sort serves top-k, top-p and
    min-p (skipped when no row uses them); greedy rows are left at temperature 1, unfiltered."""
    vocab = logits.shape[1]
    dev = logits.device
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
    x = logits / temperature[:, None]
    filtered = [p for p in params if not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0)]
    if not filtered:
        return x
    vals, order = torch.sort(x, dim=-1, descending=True)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab for p in params], device=dev)
    vals = vals.masked_fill(vals < vals.gather(1, (top_k - 1)[:, None]), float("-inf"))  # ties with the k-th stay
    if any(p.top_p < 1.0 for p in filtered):
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 and not p.greedy else float("inf") for p in params],
                             device=dev)
        probs = torch.softmax(vals, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        vals = vals.masked_fill((torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None], float("-inf"))
    if any(p.min_p > 0.0 for p in filtered):
        min_p = torch.tensor([0.0 if p.greedy else p.min_p for p in params], device=dev)
        probs = torch.softmax(vals, dim=-1)  # column 0 holds each row's most likely token: never dropped
        vals = vals.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
    return torch.empty_like(x).scatter_(1, order, vals)


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64 ``[R]``, the first maximal index per row): in C on the CPU
    (``cpu_native.argmax_rows``; torch's CPU argmax took ~88 us a row at a 49,152-token vocabulary)."""
    if logits.device.type == "cpu":
        picked = cpu_native.argmax_rows(logits)
        if picked is not None:
            return picked
    return logits.argmax(dim=-1)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator,
                 row_generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
    """One token per row, all rows at once on the logits' device.

    :func:`filter_logits_batch`, then the draw: on a GPU by the exponential race (``argmax(p / E)`` with
    ``E ~ Exp(1)`` i.i.d.: token ``j`` wins with probability ``p_j``; vLLM samples the same way), which
    needs no device sync and no per-row work; on the CPU by inversion (the first token whose cumulative
    probability exceeds ``U * total``, ``U ~ Uniform[0, 1)``, one per row): the same distribution from one
    random number per row instead of one per vocabulary entry (torch's CPU ``exponential_`` took ~0.8 ms a
    row at a 49,152-token vocabulary, a tenth of a small model's decode step). Greedy rows take the argmax.

    Args:
        logits: fp32 ``[R, vocab]`` (penalties and banned ids already applied).
        params: one :class:`SamplingParams` per row.
        generator: a generator on ``logits.device`` for the noise of rows without their own.
        row_generators: row -> the request's own generator (on ``logits.device``): that row's noise
            comes from it alone, so its draws do not depend on the rest of the batch.
    Returns:
        int64 ``[R]`` token ids on ``logits.device``.
    """
    argmax = greedy_pick(logits)
    if all(p.greedy for p in params):
        return argmax
    probs = torch.softmax(filter_logits_batch(logits, params), dim=-1)
    if probs.device.type == "cpu":
        sampled = sample_by_inversion(probs, params, generator, row_generators or {}, argmax)
    else:
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for row, gen in (row_generators or {}).items():
            if not params[row].greedy:
                noise[row].exponential_(generator=gen)
        sampled = (probs / noise.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    return torch.where(greedy, argmax, sampled)


def sample_by_inversion(probs: torch.Tensor, params: list[SamplingParams], generator: torch.Generator,
                         row_generators: dict[int, torch.Generator], argmax: torch.Tensor) -> torch.Tensor:
    """:func:`sample_batch`'s CPU draw: per row ``U`` from its generator (its own where it has one), the first
    index whose cumulative probability exceeds ``U * total``. A token of probability 0 adds nothing to the sum,
    so it is never the first to exceed it; only ``U * total`` rounding up to the total itself could pick one,
    and such a row (about one in 2^24) takes its argmax."""
    u = torch.rand(len(probs), 1, generator=generator, dtype=probs.dtype)
    for row, gen in row_generators.items():
        if not params[row].greedy:
            u[row] = torch.rand(1, generator=gen, dtype=probs.dtype)
    cdf = probs.cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_max_(probs.shape[1] - 1)
    return torch.where(probs.gather(1, sampled[:, None]).squeeze(1) > 0, sampled, argmax)


class Sampler:
    """Samples one token per row, on the device of the logits.

    All rows go through one batched draw (:func:`sample_batch`); only the token ids (and requested
    logprobs) come back to the host. Rows with penalties or banned ids get them applied to their own
    row first; a request with a seed draws its noise from its own generator, so its tokens do not
    depend on the batch it shares.

    Args:
        seed: seed of the shared generators (one per device) used by requests without their own seed;
            None: 63 random bits from the OS (:func:`os.urandom`), so unseeded sampling differs between
            processes. ``self.seed`` is the seed in use either way.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The shared generator on ``device`` (created and seeded with ``seed`` at first use)."""
        device = torch.device(device)
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
            self._generators[device].manual_seed(self.seed)
        return self._generators[device]

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """Sample.

        Args:
            logits: fp32 ``[len(rows), vocab]``, on any device.
            rows: one :class:`SamplingRow` per logits row; a row's ``generator`` must be on that device.
        Returns:
            ``(token_ids, logprobs)``: a token per row, and per row either None or
            ``{token_id: logprob}`` for the top ``params.logprobs`` tokens plus the sampled one
            (log-probabilities of the model's raw distribution, before penalties and filters).
            A row whose logits have no finite maximum (NaN, +inf, or all -inf: the forward overflowed
            or broke) gets :data:`INVALID_TOKEN` and no logprobs: any id drawn from it would be noise.
        """
        raw = logits.to(torch.float32)
        x = adjusted_logits(raw, rows)
        own = {i: row.generator for i, row in enumerate(rows) if row.generator is not None}
        sampled = sample_batch(x, [row.params for row in rows], self.generator_for(raw.device), own)
        # amax is NaN if any logit is, +inf if one is, -inf if all are: one reduction finds every broken row,
        # and the verdict comes back in the same copy as the tokens.
        broken = ~torch.isfinite(raw.amax(dim=-1))
        tokens = torch.where(broken, INVALID_TOKEN, sampled).tolist()
        return tokens, self.logprobs(raw, rows, tokens)

    @staticmethod
    def logprobs(logits: torch.Tensor, rows: list[SamplingRow], tokens: list[int]) -> list[dict[int, float] | None]:
        """Per row None, or the raw log-probabilities of its top ``params.logprobs`` tokens and of its token
        (computed together on the logits' device, copied back once)."""
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None and tokens[i] != INVALID_TOKEN]
        out: list[dict[int, float] | None] = [None] * len(rows)
        if not wanted:
            return out
        dev = logits.device
        lp = torch.log_softmax(logits[torch.tensor(wanted, dtype=torch.long, device=dev)], dim=-1)
        chosen = lp.gather(1, torch.tensor([tokens[i] for i in wanted], dtype=torch.long, device=dev)[:, None])
        k = max(rows[i].params.logprobs for i in wanted)
        top = torch.topk(lp, k, dim=-1) if k else None
        chosen_h = chosen.squeeze(1).tolist()
        top_v, top_i = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs
            # tokens a grammar masked out (-inf) are not candidates: never listed
            entry = {int(t): float(v) for t, v in zip(top_i[j][:n], top_v[j][:n]) if v != -math.inf} if n else {}
            entry[tokens[i]] = float(chosen_h[j])
            out[i] = entry
        return out

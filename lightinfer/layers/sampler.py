"""Turn logits into next tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightinfer.sampling_params import SamplingParams


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


class Sampler:
    """Samples one token per row.

    Args:
        seed: seed of the shared generator used by requests without their own seed.
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """Sample.

        Args:
            logits: fp32 ``[len(rows), vocab]``.
            rows: one :class:`SamplingRow` per logits row.
        Returns:
            ``(token_ids, logprobs)``: a token per row, and per row either None or
            ``{token_id: logprob}`` for the top ``params.logprobs`` tokens plus the sampled one
            (log-probabilities of the model's raw distribution, before penalties and filters).
        """
        logits = logits.to(torch.float32).cpu()  # tiny next to the forward; keeps generators on CPU
        # Plain greedy rows (no penalties, nothing suppressed) share one batched argmax.
        plain = [row.params.greedy and not row.suppress_token_ids and not has_penalties(row.params) for row in rows]
        argmax = logits.argmax(dim=-1).tolist() if any(plain) else []
        tokens: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        for i, row in enumerate(rows):
            raw = logits[i]
            if plain[i]:
                token = argmax[i]
            else:
                x = apply_penalties(raw.clone(), row)
                if row.suppress_token_ids:
                    x[list(row.suppress_token_ids)] = float("-inf")
                if row.params.greedy:
                    token = int(torch.argmax(x))
                else:
                    probs = torch.softmax(filter_logits(x, row.params), dim=-1)
                    gen = row.generator if row.generator is not None else self.generator
                    token = int(torch.multinomial(probs, 1, generator=gen))
            tokens.append(token)
            if row.params.logprobs is None:
                logprobs.append(None)
                continue
            lp = torch.log_softmax(raw, dim=-1)
            top = torch.topk(lp, row.params.logprobs) if row.params.logprobs else None
            entry = {int(t): float(v) for t, v in zip(top.indices, top.values)} if top is not None else {}
            entry[token] = float(lp[token])
            logprobs.append(entry)
        return tokens, logprobs

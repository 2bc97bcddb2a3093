"""Random weights of a real model config, for speed and memory benchmarks without a checkpoint.

``LLM(config_folder, load_format="dummy")`` (CLI ``--dummy-weights``) builds the model from
``config.json`` alone and fills every tensor on its device, already in the run-time layout: no
file is read, nothing passes through host memory, and a 7-8B model is ready in about a second.
The outputs are meaningless tokens; shapes, bytes moved and kernels run are those of the real
model, which is all a throughput or memory figure depends on (as vLLM's ``load_format="dummy"``).
"""

from __future__ import annotations

import torch
from torch import nn

from lightinfer.layers.linear import W4A16Linear
from lightinfer.layers.moe import FusedMoE
from lightinfer.layers.norm import RMSNorm

# Std of the dense weights and of the dequantized 4-bit weights: the usual initializer_range,
# small enough that 32 fp16 layers of random weights neither overflow nor vanish.
DUMMY_STD = 0.02
DUMMY_WEIGHTS_SEED = 0  # dummy weights of an engine started without a seed (EngineConfig.seed=None)
AWQ_GROUP_SIZES = (128, 64, 32)
# Codes uniform in [0, 15] minus a zero of 8 have std sqrt((16^2 - 1) / 12) ~ 4.61.
_CODE_STD = ((16**2 - 1) / 12) ** 0.5


def dummy_awq_config(hf_config: object) -> dict:
    """The ``quantization_config`` a dummy 4-bit model is built with (AutoAWQ gemm, zero point).

    The group size is the largest of 128/64/32 dividing every quantized layer's input size.

    Raises:
        ValueError: no such group size (tiny or unusual shapes).
    """
    from lightinfer.models.registry import get_model_class

    sizes = tuple(get_model_class(hf_config).linear_input_sizes(hf_config).values())
    for g in AWQ_GROUP_SIZES:
        if all(s % g == 0 for s in sizes):
            return {"quant_method": "awq", "bits": 4, "group_size": g, "version": "gemm", "zero_point": True,
                    "modules_to_not_convert": None}
    raise ValueError(f"no AWQ group size in {AWQ_GROUP_SIZES} divides the layer input sizes {sizes}; "
                     f"this config cannot be built with 4-bit dummy weights (drop quantization='awq')")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int | None = None) -> None:
    """Fill every parameter and 4-bit buffer of ``model`` in place with seeded random values.

    Dense weights and biases: normal(0, ``DUMMY_STD``). RMSNorm weights: 1. ``W4A16Linear`` and W4
    MoE experts: uniformly random 4-bit codes (random bytes written straight into ``qweight``), zero
    point 8 and scales around ``DUMMY_STD / 4.61`` (so the dequantized weight has the dense std).
    The generators live on the tensors' devices, so nothing is built on the host.

    Args:
        model: a lightinfer model (freshly constructed; its tensors may hold anything).
        seed: the same seed gives the same weights on the same device; None: :data:`DUMMY_WEIGHTS_SEED`
            (an engine without a seed samples from the OS, but its dummy weights stay those of every run, so
            benchmarks compare like with like).
    """
    if seed is None:
        seed = DUMMY_WEIGHTS_SEED
    generators: dict[torch.device, torch.Generator] = {}

    def gen(t: torch.Tensor) -> torch.Generator:
        # one generator per device: MoE experts kept in host memory (--cpu-experts) sit beside GPU tensors
        if t.device not in generators:
            generators[t.device] = torch.Generator(device=t.device)
            generators[t.device].manual_seed(seed)
        return generators[t.device]

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0 - getattr(module, "weight_offset", 0.0))  # a scale of 1 (Gemma's 1 + w too)
        elif isinstance(module, W4A16Linear):
            _fill_w4(module.qweight, module.scales, module.zeros, gen(module.qweight))
            module.integer_zeros = True
        elif isinstance(module, FusedMoE):
            for stack in (s for s in module.STACKS if module.is_quantized(s)):
                qweight = getattr(module, f"{stack}_qweight")
                _fill_w4(qweight, getattr(module, f"{stack}_scales"), getattr(module, f"{stack}_zeros"), gen(qweight))
            module.weights_changed()
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for param in model.parameters():  # deduplicated: a tied head is filled once
        if id(param) not in norms:
            param.normal_(0.0, DUMMY_STD, generator=gen(param))


def _fill_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, gen: torch.Generator) -> None:
    """Random 4-bit weights: a contiguous int32 ``[..., N, K/8]`` viewed as bytes (every nibble uniform in
    [0, 15]), zero point 8, scales around ``DUMMY_STD / 4.61`` (dequantized std ``DUMMY_STD``)."""
    qweight.view(torch.uint8).random_(0, 256, generator=gen)
    scales.uniform_(0.5 * DUMMY_STD / _CODE_STD, 1.5 * DUMMY_STD / _CODE_STD, generator=gen)
    zeros.fill_(8.0)

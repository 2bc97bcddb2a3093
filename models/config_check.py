"""Checks on a model config's sizes, before anything is built from them.

A config's sizes decide every allocation, so a wrong one must fail here with the file and the field,
not as a ``ZeroDivisionError`` in a constructor, a negative-dimension tensor, or minutes spent building
a million layers. The fields are those every transformers decoder config has; an architecture adds its
own through :meth:`lightinfer.models.base.CausalLM.validate_config`.

The upper bounds are far above any released model (the largest have ~128 layers, hidden 16,384,
vocabularies of ~260k and contexts of ~10M tokens) and low enough that no arithmetic on them overflows
or takes long.
"""

from __future__ import annotations

from typing import Any

# field -> largest accepted value
SIZE_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 19,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 1 << 24,
}


def config_value(config: Any, name: str) -> Any:
    """``config[name]`` of a dict or ``config.name`` of a transformers config; None when absent."""
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def check_size(config: Any, name: str, where: str, required: bool = True,
               field_names: dict[str, str] | None = None) -> int | None:
    """The integer field ``name`` of ``config`` after checking it is in ``1..SIZE_LIMITS[name]``.

    Args:
        where: the file the config came from, for the message.
        required: whether a missing field is an error (else None is returned).
        field_names: how the file names each field where it differs (GGUF metadata keys).
    Raises:
        ValueError: naming ``where`` and the field: missing, not an integer, < 1 or above the limit.
    """
    value = config_value(config, name)
    label = (field_names or {}).get(name, name)
    limit = SIZE_LIMITS[name]
    if value is None:
        if required:
            raise ValueError(f"{where}: {label} is missing; a decoder config needs it (a positive integer)")
        return None
    if isinstance(value, bool) or not isinstance(value, int):  # a bad file is a ValueError, whatever the type
        raise ValueError(  # noqa: TRY004
            f"{where}: {label} is {value!r}; it must be a positive integer (at most {limit:,})")
    if value < 1:
        raise ValueError(f"{where}: {label} is {value}; it must be a positive integer (at most {limit:,})")
    if value > limit:
        raise ValueError(f"{where}: {label} is {value:,}, beyond any real model (at most {limit:,} is accepted); "
                         f"the config is corrupt or not a model's")
    return value


def check_decoder_sizes(config: Any, where: str, field_names: dict[str, str] | None = None) -> None:
    """The sizes every decoder-only transformer config has: positive, within :data:`SIZE_LIMITS`, and
    consistent (the attention heads divide ``hidden_size`` unless ``head_dim`` is given; the key/value heads
    divide the attention heads; ``head_dim`` is even, as RoPE rotates pairs).

    Args:
        config: a transformers config or the raw ``config.json`` dict (fields left out are skipped where
            transformers has a default for them).
        where: the file, for the message. field_names: see :func:`check_size`.
    Raises:
        ValueError: naming ``where`` and the field.
    """
    raw = isinstance(config, dict)
    names = field_names or {}
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
        check_size(config, name, where, required=False, field_names=names)
    hidden = check_size(config, "hidden_size", where, required=not raw, field_names=names)
    heads = check_size(config, "num_attention_heads", where, required=not raw, field_names=names)
    kv_heads = check_size(config, "num_key_value_heads", where, required=False, field_names=names)
    head_dim = check_size(config, "head_dim", where, required=False, field_names=names)
    label = names.get
    if heads is not None and kv_heads is not None and (kv_heads > heads or heads % kv_heads):
        raise ValueError(f"{where}: {label('num_key_value_heads', 'num_key_value_heads')}={kv_heads} does not divide "
                         f"{label('num_attention_heads', 'num_attention_heads')}={heads}; each key/value head serves "
                         f"a whole group of attention heads")
    if head_dim is None and hidden is not None and heads is not None:
        if hidden % heads:
            raise ValueError(f"{where}: {label('hidden_size', 'hidden_size')}={hidden} is not a multiple of "
                             f"{label('num_attention_heads', 'num_attention_heads')}={heads} and there is no head_dim")
        head_dim = hidden // heads
    if head_dim is not None and head_dim % 2:
        raise ValueError(f"{where}: the head size is {head_dim}; rotary embeddings need an even head size")

"""A sentence-transformers model folder's pooling rules, read from its JSON files (sentence-transformers itself
is not needed)::

    modules.json                        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                                         {"idx": 1, "name": "1", "path": "1_Pooling", "type": "...models.Pooling"},
                                         {"idx": 2, "name": "2", "path": "2_Normalize", "type": "...models.Normalize"}]
    1_Pooling/config.json               {"word_embedding_dimension": 1024, "pooling_mode_lasttoken": true, ...}
    config_sentence_transformers.json   {"truncate_dim": 256, ...}   (optional)

Pooling modes run here: ``pooling_mode_lasttoken`` (LAST), ``pooling_mode_mean_tokens`` (MEAN),
``pooling_mode_cls_token`` (CLS), one at a time. Modules other than Transformer, Pooling and Normalize
(a Dense projection, a LayerNorm...) and the other pooling modes are refused with the file and the module,
never skipped: the vectors would be silently different from the model's.
"""

from __future__ import annotations

import json
from pathlib import Path

from lightinfer.inputs.pooling import PoolerConfig

MODULES_FILE = "modules.json"
_PREFIX = "sentence_transformers.models."
_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def lists_pooling_module(folder: Path) -> bool:
    """Whether ``folder`` is a sentence-transformers model with a Pooling module (what ``runner="auto"`` reads as
    "an embedding model"); an unreadable ``modules.json`` counts as none (:func:`read_pooler_config` says why)."""
    try:
        modules = json.loads((folder / MODULES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(modules, list) and any(isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")
                                             for m in modules)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} is missing (the sentence-transformers module lists it)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({e}); re-download or re-export it") from None


def read_pooler_config(folder: Path, hidden_size: int, hf_config: object = None) -> PoolerConfig | None:
    """The pooling rules of the sentence-transformers model in ``folder``; None without ``modules.json``.

    Args:
        folder: the model folder.
        hidden_size: the model's hidden size (``word_embedding_dimension`` must match it).
        hf_config: the transformers config, for ``matryoshka_dimensions`` / ``is_matryoshka`` (as vLLM reads them).
    Raises:
        ValueError: naming the file: unreadable JSON, a module lightinfer does not run, no Pooling module, a
            pooling mode other than last token / mean / CLS or more than one at once, ``include_prompt: false``,
            a ``word_embedding_dimension`` other than ``hidden_size``, a bad ``truncate_dim``.
    """
    path = folder / MODULES_FILE
    if not path.is_file():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path} must be a JSON list of modules ({{'path', 'type'}} objects)")
    pooling_dir: Path | None = None
    normalize = False
    for m in modules:
        kind = str(m.get("type", ""))
        short = kind.removeprefix(_PREFIX)
        if short == "Transformer":
            if m.get("path") not in ("", None, "."):
                raise ValueError(f"{path}: the Transformer module lives in {m.get('path')!r}; lightinfer reads the "
                                 f"model from the folder itself (path \"\")")
        elif short == "Pooling":
            pooling_dir = folder / str(m.get("path", ""))
        elif short == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{path} lists the module {kind!r}, which lightinfer does not run (it runs Transformer, "
                             f"Pooling and Normalize): its embeddings would differ from the model's")
    if pooling_dir is None:
        raise ValueError(f"{path} lists no sentence_transformers.models.Pooling module: how the model pools is "
                         f"unknown")
    where = pooling_dir / "config.json"
    cfg = _read_json(where)
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} must hold a JSON object")  # noqa: TRY004 - a bad file is a ValueError
    chosen = [mode for key, mode in _MODES.items() if cfg.get(key)]
    other = [key for key in _OTHER_MODES if cfg.get(key)]
    if other:
        raise ValueError(f"{where}: {', '.join(other)} is not supported; lightinfer pools by "
                         f"{', '.join(_MODES)}")
    if len(chosen) != 1:
        raise ValueError(f"{where} sets {len(chosen)} of {', '.join(_MODES)}; lightinfer pools by exactly one")
    if cfg.get("include_prompt", True) is False:
        raise ValueError(f"{where}: include_prompt false (pooling that leaves an instruction out) is not supported")
    dim = cfg.get("word_embedding_dimension")
    if dim is not None and dim != hidden_size:
        raise ValueError(f"{where}: word_embedding_dimension {dim} is not the model's hidden_size {hidden_size}")
    st_config = folder / "config_sentence_transformers.json"
    st = _read_json(st_config) if st_config.is_file() else {}
    truncate = st.get("truncate_dim") if isinstance(st, dict) else None
    if truncate is not None and (isinstance(truncate, bool) or not isinstance(truncate, int)
                                 or not 1 <= truncate <= hidden_size):
        raise ValueError(f"{st_config}: truncate_dim must be an integer in 1..{hidden_size}, got {truncate!r}")
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerConfig(chosen[0], normalize, hidden_size,
                        tuple(int(d) for d in dims) if isinstance(dims, (list, tuple)) else None,
                        getattr(hf_config, "is_matryoshka", True) is not False, truncate,
                        f"{MODULES_FILE}, {pooling_dir.name}/config.json")

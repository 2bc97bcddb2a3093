"""``MoeSpec``: where a mixture-of-experts family's config keeps its settings and how its checkpoints name the
experts (shared by the MoE block, ``moe.py``, and the size arithmetic, ``sizes.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from lightinfer.layers.moe import check_top_k


@dataclass(frozen=True)
class MoeSpec:
    """Where a family's config keeps its MoE settings and how its checkpoint names the experts.

    Attributes:
        num_experts: config field with E. intermediate: field with one expert's width.
        block_name: the decoder layer's attribute (and checkpoint name) of the feed-forward.
        proj_names: expert e's gate, up and down projections under ``{block}.experts.{e}``.
        norm_topk_field: config field of the renormalization flag; None: always renormalize (Mixtral).
        shared_intermediate: config field of the shared expert's width (Qwen2-MoE), or None.
        sparse_step: whether ``decoder_sparse_step`` / ``mlp_only_layers`` choose the sparse layers.
    """

    num_experts: str
    intermediate: str
    block_name: str = "mlp"
    proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    norm_topk_field: str | None = "norm_topk_prob"
    shared_intermediate: str | None = None
    sparse_step: bool = True

    def num_experts_of(self, c: object) -> int:
        return int(getattr(c, self.num_experts))

    def is_sparse(self, c: object, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has the MoE block (else a dense MLP), as transformers decides."""
        if not self.sparse_step:
            return True
        step = int(getattr(c, "decoder_sparse_step", 1) or 1)
        only_mlp = getattr(c, "mlp_only_layers", None) or []
        return layer_idx not in only_mlp and self.num_experts_of(c) > 0 and (layer_idx + 1) % step == 0

    def sparse_layers(self, c: object) -> list[int]:
        return [i for i in range(int(c.num_hidden_layers)) if self.is_sparse(c, i)]

    def renormalize(self, c: object) -> bool:
        return True if self.norm_topk_field is None else bool(getattr(c, self.norm_topk_field, False))

    def shared_size(self, c: object) -> int:
        return int(getattr(c, self.shared_intermediate, 0) or 0) if self.shared_intermediate else 0

    def check(self, c: object) -> None:
        """Raises ValueError for a config the block cannot run (top-k beyond the experts)."""
        if self.sparse_layers(c):
            check_top_k(self.num_experts_of(c), int(c.num_experts_per_tok), "config.json")

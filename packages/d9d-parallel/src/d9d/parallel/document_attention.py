"""Attention over packed documents: causal within a document, nothing across documents.

Packed rows (several samples in one row of `seq` tokens, `d9d.data.SFTDataset(pack=True)` or
`document_masking`) carry `document_ids` [batch, seq]. Token q may attend to token k iff k <= q and
both belong to one document. `DocumentMask` is built once per batch from the ids and shared by every
layer; its `attention(q, k, v)` runs one of two kernels with the same result:

- `"flex"`: FlexAttention (`torch.nn.attention.flex_attention`) with a block mask. Only the blocks
  that hold attended pairs are computed. On CUDA both the attention and the block mask's
  construction are compiled, so the mask is built block by block, never as a [seq, seq] tensor
  (eager construction, used elsewhere, materializes it). torch has no FlexAttention backward on
  CPU; the CUDA path (forward and backward) has not been run in d9d's tests, which have no GPU.
- `"sdpa"`: `scaled_dot_product_attention` with a dense boolean [batch, 1, seq, seq] mask. It runs
  everywhere and trains on CPU, but the mask costs seq² bytes per row and a masked SDPA cannot use
  the flash kernel.

`"auto"` picks FlexAttention on CUDA and SDPA elsewhere.
"""

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = ["DocumentAttentionBackend", "DocumentMask", "document_attention_backend"]

DocumentAttentionBackend = Literal["auto", "flex", "sdpa"]

#: What `_compiled_on_cuda` compiled in this process, by the function compiled.
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}


def document_attention_backend(device: torch.device, backend: DocumentAttentionBackend = "auto") -> str:
    """The kernel `DocumentMask` uses on `device`: "flex" or "sdpa" ("auto": flex on CUDA only).

    Raises:
        ValueError: an unknown backend name.
    """
    if backend not in ("auto", "flex", "sdpa"):
        raise ValueError(f"document attention backend must be 'auto', 'flex' or 'sdpa', got {backend!r}")
    if backend != "auto":
        return backend
    return "flex" if device.type == "cuda" else "sdpa"


class DocumentMask:
    """The block-causal mask of one batch of packed rows, and attention under it.

    Args:
        document_ids: int [batch, seq], the document of each token (any ids; padding may have its
            own id, e.g. d9d.data's -1: it then attends only to padding before it).
        backend: "auto", "flex" or "sdpa" (see the module docstring).
    """

    def __init__(self, document_ids: torch.Tensor, *, backend: DocumentAttentionBackend = "auto") -> None:
        if document_ids.dim() != 2:
            raise ValueError(f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}")
        self.document_ids = document_ids
        self.backend = document_attention_backend(document_ids.device, backend)
        if self.backend == "flex":
            self._block_mask: Any = _mask_builder(document_ids.device)(document_ids)
            self._dense: torch.Tensor | None = None
        else:
            self._block_mask = None
            self._dense = self.dense()

    def dense(self) -> torch.Tensor:
        """Bool [batch, 1, seq, seq]: True where token q (dim 2) may attend to token k (dim 3)."""
        ids = self.document_ids
        seq = ids.shape[-1]
        same = ids[:, :, None] == ids[:, None, :]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
        return (same & causal).unsqueeze(1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of q [batch, heads, seq, dim] over k, v [batch, kv_heads, seq, dim] (GQA when
        kv_heads divides heads) under the mask; [batch, heads, seq, dim]."""
        gqa = q.shape[1] != k.shape[1]
        if self._dense is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self._dense, enable_gqa=gqa)
        return _flex(q.device)(q, k, v, block_mask=self._block_mask, enable_gqa=gqa)


def _build_block_mask(document_ids: torch.Tensor) -> Any:
    """FlexAttention's block mask of `document_ids` [batch, seq]: causal within a document.

    The mask function is made here, inside what `_mask_builder` compiles, so the compiled graph
    takes the ids as its input: a batch with other documents (same shape) reuses it.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = document_ids.shape

    def same_document_causal(b: Any, h: Any, q: Any, k: Any) -> Any:
        return (document_ids[b, q] == document_ids[b, k]) & (q >= k)

    return create_block_mask(same_document_causal, batch, None, seq, seq, device=document_ids.device)


def _mask_builder(device: torch.device) -> Callable[[torch.Tensor], Any]:
    """`_build_block_mask`, compiled once per process on CUDA, eager elsewhere.

    Compiled, the mask is built block by block and never as a [seq, seq] tensor. `dynamic=None`:
    one graph per process for one sequence length; a second length (an eval set's) recompiles once
    with the length dynamic, and later lengths reuse that graph.
    """
    return _compiled_on_cuda(_build_block_mask, device, dynamic=None)


def _flex(device: torch.device) -> Callable[..., Any]:
    """FlexAttention: compiled once on CUDA (the fused kernel), eager elsewhere (forward only on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_on_cuda(flex_attention, device, dynamic=False)


def _compiled_on_cuda(
    fn: Callable[..., Any], device: torch.device, *, dynamic: bool | None
) -> Callable[..., Any]:
    """`fn` compiled on the first call for a CUDA device (the same one afterwards); `fn` elsewhere."""
    if device.type != "cuda":
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=dynamic)
    return _compiled[fn]

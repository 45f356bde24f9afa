"""What the reference decoder's attention takes besides q, k, v: the mask of packed documents (built once
per batch) and the KV cache of generation. Plain PyTorch; d9d.parallel's `DocumentMask` where installed.
"""

from typing import Any

import torch

__all__ = ["KVCache", "attention_mask", "block_causal", "document_mask"]


def block_causal(document_ids: torch.Tensor) -> torch.Tensor:
    """Bool [batch, 1, seq, seq]: token q attends to token k iff k <= q and both are of one document."""
    seq = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)


def document_mask(document_ids: torch.Tensor, backend: str = "auto", context_parallel: Any = None) -> Any:
    """The attention mask of packed documents, built once per batch: `d9d.parallel.DocumentMask` with
    `backend` ("auto": FlexAttention on CUDA, masked SDPA elsewhere; "flex"; "sdpa") over the cp group
    `context_parallel` (None: one process; the ids are then this rank's share of the rows), or
    `block_causal`'s tensor without d9d.parallel."""
    try:
        from d9d.parallel import DocumentMask
    except ImportError:  # the model itself is plain PyTorch
        return block_causal(document_ids)
    return DocumentMask(document_ids, backend=backend, context_parallel=context_parallel)  # type: ignore[arg-type]


def attention_mask(
    document_ids: torch.Tensor | None,
    backend: str,
    inputs: torch.Tensor,
    seq: int,
    context_parallel: Any = None,
) -> Any:
    """What every layer attends under: the document mask of packed rows; with FlexAttention
    (`backend` "flex") the causal mask as a one-document `DocumentMask`; else None (SDPA's causal).
    Under context parallelism (`context_parallel`, the cp group) `document_ids` and `seq` are this
    rank's share."""
    if document_ids is not None:
        return document_mask(document_ids, backend, context_parallel)
    if backend != "flex":
        return None
    zeros = torch.zeros(inputs.shape[0], seq, dtype=torch.long, device=inputs.device)
    return document_mask(zeros, backend, context_parallel)


class KVCache:
    """The keys and values of the tokens seen so far, for generating one token at a time.

    One [batch, kv_heads, max_length, head_dim] buffer pair per layer (made in the dtype and on the
    device of the layer's first keys), filled from position 0;
    `length` tokens are held. `ReferenceForCausalLM.new_kv_cache` makes one;
    `ReferenceForCausalLM.forward(..., kv_cache=cache)` appends the new tokens' keys and values,
    attends over everything held, and advances `length`.
    """

    def __init__(self, max_length: int) -> None:
        self.keys: dict[str, torch.Tensor] = {}  # by layer name, made at the layer's first tokens
        self.values: dict[str, torch.Tensor] = {}
        self.max_length = max_length
        self.length = 0

    def extend(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k`, `v` ([batch, kv_heads, seq, head_dim]) after the held tokens of `layer`; the keys
        and values of every token held and new (the cache's `length` moves on in `advance`)."""
        end = self.length + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"the KV cache holds {self.max_length} tokens; {end} were asked for")
        if layer not in self.keys:  # in the dtype and on the device the layer computes in
            batch, heads, _, width = k.shape
            self.keys[layer] = k.new_zeros(batch, heads, self.max_length, width)
            self.values[layer] = v.new_zeros(batch, heads, self.max_length, width)
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, tokens: int) -> None:
        """Count `tokens` more as held (after every layer stored them)."""
        self.length += tokens

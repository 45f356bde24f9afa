"""Context parallelism: per-rank saved activations and step time at cp 1, 2, 4 for 1k, 4k and 16k tokens.

    OMP_NUM_THREADS=1 uv run python benchmarks/context_parallel.py [--seq 1024 4096] [--quick]

The model is the reference model (`d9d.trainer.models`) at a tiny width (hidden 64, 2 layers,
4 query heads, 2 key/value heads, head_dim 16), batch 1, with `parallelize_context_parallel` over the
`cp` axis of `DistributedContext.from_env(MeshConfig(context_parallel=cp))`; each rank feeds its
`shard_sequence` of the tokens and computes the loss of its own tokens. Ranks are forked gloo
processes (`run_distributed`).

Memory is what one forward + loss saves for backward on each rank, counted exactly from autograd's
saved tensors (each storage once, parameters excluded): the total by `saved_activation_bytes`, and in
a second forward the same bytes split by a pack hook into the full-sequence K/V that attention
gathers, the explicit mask attention builds on CPU, the rest of attention's saved tensors (q, output,
log-sum-exp), and everything outside attention. The split must add up to the total (checked).
Transient buffers (the all-gather's receive buffer, backward's K/V gradients) are not saved tensors
and are not counted. Step time is forward + backward (no optimizer, no gradient reduction), the
median of a few repeats, of the slowest rank. Ratios are against cp 1 at the same sequence length.
"""

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch._dynamo  # imported once here, not in every forked rank (seconds each)
import torch.nn.functional as F
from _common import MB, row, write_rows
from torch import nn

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    ContextParallel,
    context_parallel_attention,
    parallelize_context_parallel,
    saved_activation_bytes,
)
from d9d.trainer.models import Attention, ReferenceForCausalLM, ReferenceModelConfig

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 257, 64, 2, 4, 2
PARTS = ("kv", "mask", "attn_other", "rest")


def _config(seq: int) -> ReferenceModelConfig:
    return ReferenceModelConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=3 * HIDDEN,
        num_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=seq,
    )


class _SplitCounter:
    """A saved-tensor pack hook that files each saved storage (once) under the part of the model saving it."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.bytes = dict.fromkeys(PARTS, 0)
        self.in_attention = False
        self.kv_storages: set[int] = set()  # the full-sequence K/V of the attention now running
        self._seen = {_key(t) for t in exclude}
        self._keep: list[torch.Tensor] = []  # hold the tensors so storage addresses stay unique

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        if key not in self._seen:
            self._seen.add(key)
            self._keep.append(tensor)
            self.bytes[self._part(tensor, key)] += tensor.untyped_storage().nbytes()
        return tensor

    def _part(self, tensor: torch.Tensor, key: int) -> str:
        if not self.in_attention:
            return "rest"
        if key in self.kv_storages:
            return "kv"
        # SDPA's CPU kernel saves the boolean [q_len, kv_len] mask converted to float; nothing else
        # attention saves is 2-D (q, output: 4-D; log-sum-exp: 3-D).
        return "mask" if tensor.dim() == 2 else "attn_other"


class _CountingContextParallel(ContextParallel):
    """The rank's cp group, unchanged, telling the counter when attention runs and which storage is K/V."""

    def __init__(self, cp: ContextParallel, counter: _SplitCounter) -> None:
        super().__init__(cp.group)
        self._counter = counter

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
    ) -> torch.Tensor:
        counter = self._counter
        # cp 1: the inputs are the whole sequence's K and V; cp > 1: the gathered copy (unshard_sequence)
        counter.kv_storages = set() if self.enabled else {_key(k), _key(v)}
        counter.in_attention = True
        try:
            return context_parallel_attention(q, k, v, self, scale=scale)
        finally:
            counter.in_attention = False

    def unshard_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        full = super().unshard_sequence(x, dim)
        self._counter.kv_storages.add(_key(full))
        return full


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _rank(cp_size: int, seq: int, warmup: int, repeats: int) -> dict[str, Any]:
    """This rank's saved bytes (total and split) and its forward+backward times."""
    with DistributedContext.from_env(MeshConfig(context_parallel=cp_size)) as ctx:
        torch.manual_seed(0)
        model = ReferenceForCausalLM(_config(seq))
        cp = parallelize_context_parallel(model, None if ctx.is_local else ctx.mesh("dense"))
        tokens = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(1))
        inputs, labels = cp.shard_sequence(tokens[:, :-1]), cp.shard_sequence(tokens[:, 1:])
        params = list(model.parameters())

        total = saved_activation_bytes(lambda: _loss(model, inputs, labels), exclude=params)
        counter = _SplitCounter(exclude=params)
        attentions = [m for m in model.modules() if isinstance(m, Attention)]
        for attention in attentions:
            attention.context_parallel = _CountingContextParallel(cp, counter)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
            _loss(model, inputs, labels)
        for attention in attentions:  # back to what parallelize_context_parallel left, for the timing
            attention.context_parallel = cp if cp.enabled else None
        split = dict(counter.bytes)
        del counter

        times = []
        for i in range(warmup + repeats):
            ctx.barrier()
            start = time.perf_counter()
            _loss(model, inputs, labels).backward()
            if i >= warmup:
                times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        return {"total": total, **split, "times": times}


def _measure(cp_size: int, seq: int, warmup: int, repeats: int) -> dict[str, Any]:
    """The bytes of the rank that saves the most (total and split), and the slowest rank's median step."""
    ranks = run_distributed(_rank, cp_size, cp_size, seq, warmup, repeats, timeout=600)
    for r, got in enumerate(ranks):
        split = sum(got[p] for p in PARTS)
        if split != got["total"]:
            raise AssertionError(f"cp {cp_size}, seq {seq}, rank {r}: split {split} != total {got['total']}")
    largest = max(ranks, key=lambda got: got["total"])
    out: dict[str, Any] = {key: largest[key] for key in ("total", *PARTS)}
    out["step"] = max(statistics.median(got["times"]) for got in ranks)
    return out


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}" if base else "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384], help="tokens per sequence")
    parser.add_argument(
        "--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes (1 first)"
    )
    parser.add_argument(
        "--repeats", type=int, help="timed forward+backward steps per run (default 5, 3 above 4k tokens)"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="at most 4k tokens, 3 repeats")
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    if args.quick:
        args.seq, args.repeats = [s for s in args.seq if s <= 4096] or [1024], args.repeats or 3
    if args.cp[0] != 1:
        parser.error("--cp must start with 1 (the baseline of every ratio)")
    for seq in args.seq:
        if any(seq % (2 * cp_size) for cp_size in args.cp):
            parser.error(
                f"--seq {seq} must be a multiple of 2 x every --cp (the load-balanced layout's chunks)"
            )
    cores = os.cpu_count() or 1
    print(
        f"# reference model: hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads / {KV_HEADS} kv heads (head_dim "
        f"{HIDDEN // HEADS}), vocab {VOCAB}, batch 1, fp32. Saved activations (MiB) of the rank saving the "
        "most; x/1 = ratio vs cp 1 at the same length"
    )
    print(
        "#   kv: the full-sequence K and V each rank saves (the all-gather design: does not shrink with cp)\n"
        "#   mask: a float [q_len, kv_len] attention mask saved for backward (0 on CPU: its path pads the\n"
        "#     queries to a square instead; CUDA builds one only for GQA where flash cannot run)\n"
        "#   attn: the rest attention saves (q, outputs, log-sum-exp): 1/cp on CUDA, more on CPU, which\n"
        "#     saves q and outputs of each non-square chunk at its padded length\n"
        "#   rest: everything outside attention, ideal 1/cp; at cp > 1 it also holds o_proj's input, a copy\n"
        "#     of the joined chunk outputs (at cp 1 a view of SDPA's saved output): one more\n"
        "#     [seq/cp, heads·head_dim] tensor per layer (and the sharded labels, 8 B a token)\n"
        "#   no-mask/1: (total - mask) / cp 1, what the same design saves where no mask is built"
    )
    print(
        f"# step: forward+backward (no optimizer or gradient reduction), median of {args.repeats or '5 (3 above 4k)'}, slowest "
        "rank; step/1 = step s / cp1 s, a cp 1 run made just before (the cp 1 row: the first one). "
        f"{cores} CPU cores: at cp > {cores} the ranks oversubscribe them, and CPU timings are noisy (±15%): "
        "ratios, not speed-ups"
    )
    print(
        f"{'seq':>6} {'cp':>3} {'total':>8} {'kv':>6} {'mask':>7} {'attn':>6} {'rest':>7}"
        f" {'total/1':>8} {'no-mask/1':>9} {'kv/1':>5} {'attn/1':>6} {'rest/1':>6} {'step s':>7} {'cp1 s':>7} {'step/1':>6}"
    )
    rows = []
    for seq in args.seq:
        base: dict[str, Any] = {}
        for cp_size in args.cp:
            repeats = args.repeats or (5 if seq <= 4096 else 3)
            if cp_size > 1 and cp_size != args.cp[1]:  # a fresh cp 1 step just before, under the same load
                base["step"] = _measure(1, seq, args.warmup, repeats)["step"]
            got = _measure(cp_size, seq, args.warmup, repeats)
            if cp_size == 1:
                base = got
            no_mask = got["total"] - got["mask"]
            print(
                f"{seq:>6} {cp_size:>3} {got['total'] / MB:>8.2f} {got['kv'] / MB:>6.2f} "
                f"{got['mask'] / MB:>7.2f} {got['attn_other'] / MB:>6.2f} {got['rest'] / MB:>7.2f} "
                f"{_ratio(got['total'], base['total']):>8} {_ratio(no_mask, base['total']):>9} "
                f"{_ratio(got['kv'], base['kv']):>5} {_ratio(got['attn_other'], base['attn_other']):>6} "
                f"{_ratio(got['rest'], base['rest']):>6} {got['step']:>7.3f} {base['step']:>7.3f} {_ratio(got['step'], base['step']):>6}",
                flush=True,
            )
            if cp_size > 1 and seq == args.seq[-1]:
                where = f"cp {cp_size}, {seq} tokens"
                rows.append(row(f"cp saved activations outside attention, {where}: / cp 1", got["rest"] / base["rest"], f"1/cp = {1 / cp_size:.3f}", "+ o_proj's input copy"))  # fmt: skip
                rows.append(row(f"cp saved activations per rank without the CPU mask, {where}: / cp 1", no_mask / base["total"], "> 1/cp (full K/V)", f"K/V {got['kv'] / base['kv']:.2f} of cp 1 (all-gather)"))  # fmt: skip
                rows.append(row(f"cp saved activations per rank on CPU, {where}: / cp 1", got["total"] / base["total"], "> 1/cp", f"incl. {got['mask'] / MB:.0f} MiB of CPU attention masks"))  # fmt: skip
                rows.append(row(f"cp step time, {where}: / cp 1", got["step"] / base["step"], "1/cp with a core per rank", f"{cp_size} ranks on {cores} cores"))  # fmt: skip
    write_rows(args.json, rows)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

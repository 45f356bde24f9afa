"""The reference model's FSDP groups (`shard_units`): the embedding and `[norm, lm_head]` are groups of
their own, so neither stays gathered for the whole step.

Measured exactly, on FSDP 2 (2 forked ranks, gloo): the bytes of unsharded parameters alive at the
peak of forward and of backward, from the storages FSDP2 gathers into (`FSDPParam._unsharded_param`,
freed by resizing its storage to 0), after every op. With only the layers as groups, the root group
(embedding, norm and head) is gathered from the first forward op to the last backward op; with
`shard_units`, the peak is the largest single group. (On a GPU, FSDP2 also prefetches the next
group while one computes; CPU runs them one after the other.)
"""

from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.mesh.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]


class GatheredBytes(TorchDispatchMode):
    """After every op: the bytes of unsharded parameters alive; the peak in forward and in backward."""

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        super().__init__()
        self.groups: list[Any] = []
        for module in model.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None and group not in self.groups:  # a multi-module group once
                    self.groups.append(group)
        self.peak = {"forward": 0, "backward": 0}

    def alive(self) -> int:
        seen: set[int] = set()
        total = 0
        for group in self.groups:
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is None:
                    continue
                storage = unsharded.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        self.peak[phase] = max(self.peak[phase], self.alive())
        return out


def _peaks(tie: bool, units: bool) -> tuple[dict[str, int], dict[str, int]]:
    """One FSDP 2 rank: the peaks of a second forward + backward (the first lazily initializes FSDP),
    and the fp32 bytes of the embedding, one layer, the norm and the head."""
    from d9d.mesh import DistributedContext, MeshConfig
    from d9d.parallel import parallelize_hsdp
    from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig, shard_units

    torch.manual_seed(0)
    config = ReferenceModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)  # fmt: skip
    model = ReferenceForCausalLM(config)
    nbytes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    sizes = {
        "embed": nbytes["model.embed_tokens.weight"],
        "layer": sum(v for k, v in nbytes.items() if k.startswith("model.layers.0.")),
        "norm": nbytes["model.norm.weight"],
        "head": 0 if tie else nbytes["lm_head.weight"],
    }
    context = DistributedContext.from_env(MeshConfig(data_parallel_shard=2), device="cpu")
    blocks = shard_units(model) if units else list(model.model.layers.values())
    parallelize_hsdp(model, context.mesh("dense"), blocks=blocks)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids).sum().backward()
    mode = GatheredBytes(model)
    with mode:
        model(ids).sum().backward()
    return mode.peak, sizes


def _before_and_after(tie: bool) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """On one FSDP 2 run of ranks: the peaks with the layers as groups, then with `shard_units`."""
    (before, sizes), (after, _) = _peaks(tie, False), _peaks(tie, True)
    return before, after, sizes


def test_the_embedding_and_the_head_are_gathered_only_while_they_compute():
    before, after, sizes = run_distributed(_before_and_after, 2, False)[0]
    embed, layer, norm, head = sizes["embed"], sizes["layer"], sizes["norm"], sizes["head"]
    assert embed > layer and head > layer  # a vocabulary larger than a layer, as in real models
    root = embed + norm + head
    assert before == {"forward": root + layer, "backward": root + layer}  # the root all along
    largest = max(embed, layer, norm + head)
    assert after == {"forward": largest, "backward": largest}  # one group at a time
    # The measured example: 168384 -> 65664 bytes (0.39); at the 8B shape (vocabulary 128256,
    # hidden 4096, bf16) the same rule gives 2.5 GB -> 1.05 GB of gathered weights per rank.


def test_a_tied_embedding_and_head_are_one_group_gathered_from_the_embedding_to_the_head():
    before, after, sizes = run_distributed(_before_and_after, 2, True)[0]
    embed, layer, norm = sizes["embed"], sizes["layer"], sizes["norm"]
    assert before == {"forward": embed + norm + layer, "backward": embed + norm + layer}
    # The shared table is needed first and last in forward, first and last in backward: it stays
    # gathered; the norm, a group of its own now, is not.
    assert after == {"forward": embed + layer, "backward": embed + layer}

"""Several pipeline stages on one rank seen as one module with the whole model's parameter names.

A multi-stage schedule (interleaved 1F1B, ZBV, ...) gives a rank several stage modules ("chunks"),
each built from the same model class and trimmed to its layers, so their parameter names are the
names one process would use (`model.layers.5.mlp.up_proj.weight`) and never collide across chunks.
`merge_stage_modules` grafts the chunks' submodules into one module tree under those names, sharing
the same module and parameter objects: an optimizer, a checkpoint (`state_dict`, DCP) or a gradient
norm over the merged module sees exactly the chunks' parameters, named as in one process, so a
checkpoint saved with one schedule or pipeline degree loads with another.
"""

from collections.abc import Iterator, Sequence

from torch import nn

from d9d.parallel.pipeline.errors import PipelineError

__all__ = ["StageChunks", "merge_stage_modules"]


class StageChunks(nn.Module):
    """The union of a rank's stage modules under their own (whole-model) names.

    `chunks` are the stage modules themselves (run them, e.g. through `Pipeline`); the merged tree
    is for everything that reads parameters by name. Calling it is an error: a pipeline runs its
    stages one by one.
    """

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        super().__init__()
        self._chunks: tuple[nn.Module, ...] = tuple(chunks)  # not registered: no "0." prefix in names
        for chunk in self._chunks:
            _graft(self, chunk, "")

    @property
    def chunks(self) -> tuple[nn.Module, ...]:
        """The stage modules, in increasing stage index."""
        return self._chunks

    def train(self, mode: bool = True) -> "StageChunks":
        """Set the mode of every chunk (their roots are not submodules of the merged tree)."""
        super().train(mode)
        for chunk in self._chunks:
            chunk.train(mode)
        return self

    def forward(self, *args: object, **kwargs: object) -> object:
        raise PipelineError("StageChunks holds several pipeline stages: run them through a Pipeline")


def merge_stage_modules(chunks: Sequence[nn.Module]) -> nn.Module:
    """One module over `chunks`: the chunk itself when there is one, else a `StageChunks`.

    Raises:
        PipelineError: two chunks hold a parameter or buffer of the same name (they are not stages
            of one model trimmed to disjoint parts).
    """
    chunks = list(chunks)
    if not chunks:
        raise PipelineError("merge_stage_modules needs at least one stage module")
    if len(chunks) == 1:
        return chunks[0]
    merged = StageChunks(chunks)
    seen: dict[str, int] = {}
    for index, chunk in enumerate(chunks):
        for name in _tensor_names(chunk):
            if name in seen:
                raise PipelineError(
                    f"stage modules {seen[name]} and {index} of this rank both hold {name!r}: stages must "
                    "keep disjoint parts of the model under its own names (see trim_to_stage)"
                )
            seen[name] = index
    return merged


def _tensor_names(module: nn.Module) -> Iterator[str]:
    """Names of the parameters and persistent buffers (what a checkpoint holds)."""
    for path, sub in module.named_modules(remove_duplicate=False):
        for name in _own_state(sub):
            yield f"{path}.{name}" if path else name


def _own_state(module: nn.Module) -> list[str]:
    """The module's own parameters and persistent buffers (non-persistent ones, e.g. RoPE tables that
    every stage recomputes, are not part of the model's state)."""
    names = [name for name, p in module._parameters.items() if p is not None]
    return names + [
        name
        for name, b in module._buffers.items()
        if b is not None and name not in module._non_persistent_buffers_set
    ]


def _owns_tensors(module: nn.Module) -> bool:
    return bool(_own_state(module))


def _only_transient(module: nn.Module) -> bool:
    """No state at all below it (e.g. a RoPE module with a non-persistent table): any copy will do."""
    return not any(_own_state(sub) for sub in module.modules())


def _graft(target: nn.Module, source: nn.Module, prefix: str) -> None:
    """Register `source`'s children under `target` by name; where a name is taken by a module of
    another chunk, replace it by a plain node that holds both modules' children."""
    if _owns_tensors(source) and source is not target:
        if prefix:  # a chunk root with tensors of its own cannot be merged with another chunk's root
            raise PipelineError(f"cannot merge {prefix!r}: it holds tensors of its own in several stages")
        raise PipelineError("cannot merge stage modules whose root holds parameters or buffers directly")
    for name, child in source.named_children():
        if child is None:
            continue
        path = f"{prefix}{name}"
        existing = target._modules.get(name)
        if existing is None:
            target.add_module(name, child)
            continue
        if existing is child or (_only_transient(existing) and _only_transient(child)):
            continue  # the same module, or one without state (each chunk keeps using its own)
        if _owns_tensors(existing) or _owns_tensors(child):
            raise PipelineError(
                f"stage modules of this rank both hold {path!r} with tensors of its own: stages must keep "
                "disjoint parts of the model (see trim_to_stage)"
            )
        if not isinstance(existing, _MergeNode):
            node = _MergeNode()
            _graft(node, existing, f"{path}.")
            target._modules[name] = node
            existing = node
        _graft(existing, child, f"{path}.")


class _MergeNode(nn.Module):
    """A container of modules from several chunks at one path (no tensors, no forward of its own)."""

    def forward(self, *args: object, **kwargs: object) -> object:
        raise PipelineError("a merged pipeline node is not callable: run the stage modules")

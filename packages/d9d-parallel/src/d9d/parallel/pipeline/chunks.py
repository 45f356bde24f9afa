"""Several pipeline stages on one rank seen as one module with the whole model's parameter names.

A multi-stage schedule (interleaved 1F1B, ZBV, ...) gives a rank several stage modules ("chunks"),
each built from the same model class and trimmed to its layers, so their parameter names are the
names one process would use (`model.layers.5.mlp.up_proj.weight`) and never collide across chunks.
`merge_stage_modules` grafts the chunks' submodules into one module tree under those names, sharing
the same module and parameter objects: an optimizer, a checkpoint (`state_dict`, DCP) or a gradient
norm over the merged module sees exactly the chunks' parameters, named as in one process, so a
checkpoint saved with one schedule or pipeline degree loads with another.

Tied parameters (`tied_parameters()` of a chunk, see `d9d.parallel.pipeline.tied`) that two chunks of
the rank hold are shown once, as in one process: every tied name reads the first chunk's copy; the
later chunk's copy is no parameter of the merged module (`Pipeline` keeps it equal to the first).
"""

from collections.abc import Iterator, Mapping, Sequence

from torch import nn

from d9d.parallel.pipeline.errors import PipelineError
from d9d.parallel.pipeline.tied import declared_ties, find_parameter

#: Per module path of a chunk, what the merged tree shows there instead (None: nothing).
_Substitutes = Mapping[str, "nn.Module | None"]

__all__ = ["StageChunks", "merge_stage_modules"]


class StageChunks(nn.Module):
    """The union of a rank's stage modules under their own (whole-model) names.

    `chunks` are the stage modules themselves (run them, e.g. through `Pipeline`); the merged tree
    is for everything that reads parameters by name. Calling it is an error: a pipeline runs its
    stages one by one.
    """

    def __init__(
        self, chunks: Sequence[nn.Module], substitutes: Sequence[_Substitutes] | None = None
    ) -> None:
        super().__init__()
        self._chunks: tuple[nn.Module, ...] = tuple(chunks)  # not registered: no "0." prefix in names
        subs = list(substitutes) if substitutes is not None else [{} for _ in self._chunks]
        for chunk, chunk_subs in zip(self._chunks, subs, strict=True):
            _graft(self, chunk, "", chunk_subs)

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


def merge_stage_modules(
    chunks: Sequence[nn.Module], *, tied: Sequence[Sequence[str]] | None = None
) -> nn.Module:
    """One module over `chunks`: the chunk itself when there is one, else a `StageChunks`.

    Args:
        tied: names of parameters that are one parameter of the model (several chunks may hold a
            copy); None reads the chunks' `tied_parameters()`.

    Raises:
        PipelineError: two chunks hold a parameter or buffer of the same name (they are not stages
            of one model trimmed to disjoint parts) that is not tied.
    """
    chunks = list(chunks)
    if not chunks:
        raise PipelineError("merge_stage_modules needs at least one stage module")
    if len(chunks) == 1:
        return chunks[0]
    ties = declared_ties(chunks) if tied is None else [tuple(t) for t in tied]
    substitutes = _tied_substitutes(chunks, ties)
    merged = StageChunks(chunks, substitutes)
    seen: dict[str, int] = {}
    for index, chunk in enumerate(chunks):
        for name in _tensor_names(chunk, substitutes[index]):
            if name in seen:
                raise PipelineError(
                    f"stage modules {seen[name]} and {index} of this rank both hold {name!r}: stages must "
                    "keep disjoint parts of the model under its own names (see trim_to_stage)"
                )
            seen[name] = index
    return merged


def _tensor_names(module: nn.Module, substitutes: _Substitutes) -> Iterator[str]:
    """Names of the parameters and persistent buffers (what a checkpoint holds), but those of tied
    copies that the merged tree shows from another chunk."""
    for path, sub in module.named_modules(remove_duplicate=False):
        if path in substitutes:
            continue
        for name in _own_state(sub):
            yield f"{path}.{name}" if path else name


def _tied_substitutes(
    chunks: list[nn.Module], ties: list[tuple[str, ...]]
) -> list[dict[str, nn.Module | None]]:
    """Per chunk, the modules holding a later copy of a tied parameter → what the merged tree shows:
    nothing where an earlier chunk shows the same module path, else an alias of the module whose tied
    parameters are the first chunk's copy."""
    subs: list[dict[str, nn.Module | None]] = [{} for _ in chunks]
    for tie in ties:
        first: nn.Parameter | None = None
        shown: set[str] = set()  # module paths showing `first`
        for index, chunk in enumerate(chunks):
            for name in tie:
                param = find_parameter(chunk, name)
                if param is None:
                    continue
                path, _, leaf = name.rpartition(".")
                if first is None or param is first:
                    first = param
                    shown.add(path)
                    continue
                module = chunk.get_submodule(path) if path else chunk
                if not path:
                    raise PipelineError(
                        f"cannot merge the tied parameter {name!r}: it sits on a chunk's root"
                    )
                if (
                    path in shown
                    and all(p is param for p in module._parameters.values() if p is not None)
                    and not (_own_buffers(module))
                ):
                    subs[index][path] = None  # the earlier chunk shows this module (its own copy) here
                    continue
                alias = subs[index].get(path) or _TiedAlias(module)
                alias._parameters[leaf] = first
                subs[index][path] = alias
                shown.add(path)
    return subs


def _own_buffers(module: nn.Module) -> list[str]:
    return [
        name
        for name, b in module._buffers.items()
        if b is not None and name not in module._non_persistent_buffers_set
    ]


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


def _graft(target: nn.Module, source: nn.Module, prefix: str, substitutes: _Substitutes) -> None:
    """Register `source`'s children under `target` by name (or their `substitutes`, by path); where
    a name is taken by a module of another chunk, replace it by a plain node that holds both modules'
    children."""
    if _owns_tensors(source) and source is not target:
        if prefix:  # a chunk root with tensors of its own cannot be merged with another chunk's root
            raise PipelineError(f"cannot merge {prefix!r}: it holds tensors of its own in several stages")
        raise PipelineError("cannot merge stage modules whose root holds parameters or buffers directly")
    for name, child in source.named_children():
        if child is None:
            continue
        path = f"{prefix}{name}"
        if path in substitutes:
            child = substitutes[path]
            if child is None:
                continue
        existing = target._modules.get(name)
        if existing is None and not any(p.startswith(f"{path}.") for p in substitutes):
            target.add_module(name, child)
            continue
        if existing is None:  # a substitute below: graft the children one by one
            node = _MergeNode()
            target._modules[name] = node
            _graft(node, child, f"{path}.", substitutes)
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
            _graft(node, existing, f"{path}.", {})  # registered whole: no substitute below it
            target._modules[name] = node
            existing = node
        _graft(existing, child, f"{path}.", substitutes)


class _MergeNode(nn.Module):
    """A container of modules from several chunks at one path (no tensors, no forward of its own)."""

    def forward(self, *args: object, **kwargs: object) -> object:
        raise PipelineError("a merged pipeline node is not callable: run the stage modules")


class _TiedAlias(nn.Module):
    """A module of a later chunk as the merged tree shows it: its tensors and children, but its tied
    parameters replaced by the first chunk's copy (not callable)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._parameters = dict(module._parameters)
        self._buffers = dict(module._buffers)
        self._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        self._modules = dict(module._modules)

    def forward(self, *args: object, **kwargs: object) -> object:
        raise PipelineError("a merged pipeline node is not callable: run the stage modules")

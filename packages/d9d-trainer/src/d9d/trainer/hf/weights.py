"""How a Hugging Face folder's weights map onto `HFCausalLM`: the import and export mappers, and the
check of a folder against the model that refuses it before anything is allocated or written.

The model's names are Hugging Face's, so both mappers are identity but for what transformers itself
does on save and load: a tied tensor (`tie_word_embeddings`) is stored once under its first name and
read into all of them, and on load the folder keys transformers ignores are dropped (a stored copy
of a tied tensor, non-persistent buffers an old export saved, the class's own ignore patterns).
A folder in transformers' checkpoint layout (one weight per MoE expert, `hf.conversion`) is read
through that layout's mapper and exported back in it.
"""

from collections.abc import Iterable, Mapping
from pathlib import Path

from d9d.ckpt import (
    Deduplicate,
    Drop,
    Duplicate,
    Identity,
    MappingError,
    Parallel,
    SafetensorsIOError,
    StateMapper,
    check_safetensors,
    safetensors_shapes,
)
from d9d.trainer.hf.conversion import SavedFormat, saved_format
from d9d.trainer.hf.errors import HFModelError
from d9d.trainer.hf.folder import CONFIG_FILE
from d9d.trainer.hf.model import HFCausalLM, HFStateLayout

__all__ = ["check_folder_weights", "export_mapper", "fresh_keys", "import_mapper"]

#: How many keys a message lists before "...".
_SHOWN = 4


def export_mapper(layout: HFStateLayout, saved: SavedFormat | None = None) -> StateMapper:
    """The model's state-dict keys → a Hugging Face folder's: identity (or the folder's `saved`
    format, e.g. one weight per MoE expert), each tied tensor stored once."""
    groups = _tie_groups(layout)
    parts: list[StateMapper] = [Deduplicate(keys, stored) for stored, keys in groups.items()]
    if saved is not None:
        parts.append(saved.mapper)
    else:
        parts.extend(Identity(key) for key in layout.stored_keys if key not in groups)
    return Parallel(parts)


def import_mapper(
    layout: HFStateLayout, source_keys: Iterable[str], saved: SavedFormat | None = None
) -> StateMapper:
    """A Hugging Face folder's keys (`source_keys`) → the model's: identity (or the inverse of the
    folder's `saved` format), each tied tensor read once into all its names, and the folder keys
    transformers ignores on load dropped unread."""
    groups = _tie_groups(layout)
    parts: list[StateMapper] = [Duplicate(stored, keys) for stored, keys in groups.items()]
    source_keys = set(source_keys)
    if saved is not None:
        parts.append(saved.mapper.inverse())
    else:
        absent = fresh_keys(layout, source_keys)  # they keep their init
        parts.extend(Identity(key) for key in layout.stored_keys if key not in groups and key not in absent)
    read = _folder_keys(layout, saved)
    ignored = sorted(k for k in source_keys if k not in read and (k in layout.tied or layout.is_ignorable(k)))
    if ignored:
        parts.append(Drop(ignored))
    return Parallel(parts)


def fresh_keys(layout: HFStateLayout, source_keys: Iterable[str]) -> frozenset[str]:
    """The model's keys a folder of `source_keys` lacks and may lack (`layout.optional`): they keep their
    init (a classifier's score on a causal LM's folder)."""
    return frozenset(layout.optional - set(source_keys))


def check_folder_weights(model: HFCausalLM, folder: Path) -> SavedFormat | None:
    """Refuse a folder whose weights do not fit the model its config.json builds, reading no tensor.

    `model` may be on the meta device. The same checks run again when the trainer loads the folder.

    Returns:
        The folder's saved format when it holds transformers' checkpoint layout rather than the
        model's own tensors (per-expert MoE weights), else None (the names are the model's).

    Raises:
        HFModelError: naming the folder (or file) and key, when a tensor is missing, extra or of
            another shape than config.json gives it, or the safetensors layout is broken.
    """
    layout = model.layout
    architecture = type(model.hf_model).__name__
    described = f"{architecture} as {folder / CONFIG_FILE} describes it"
    try:
        shapes = safetensors_shapes(folder)
    except SafetensorsIOError as exc:
        raise HFModelError(f"model.folder: {exc}") from None
    saved = _folder_format(model, shapes)
    expected = _folder_keys(layout, saved)
    extra = sorted(
        k for k in shapes if k not in expected and k not in layout.tied and not layout.is_ignorable(k)
    )
    if extra:
        raise HFModelError(
            f"model.folder: {folder} holds {len(extra)} tensors that {described} does not have "
            f"({_listed(extra)}); the weights are of another model: use the config.json they were saved with"
        )
    missing = sorted(k for k in expected if k not in shapes and k not in layout.optional)
    if missing:
        raise HFModelError(
            f"model.folder: {folder} lacks {len(missing)} tensors of {described} ({_listed(missing)}); "
            "the folder is incomplete or of another model: copy the missing weights in, or use the "
            "config.json they were saved with"
        )
    try:
        absent = fresh_keys(layout, shapes)
        target = {k: v for k, v in model.state_dict().items() if k not in absent} if absent else model
        check_safetensors(target, folder, mapper=import_mapper(layout, shapes, saved))
    except SafetensorsIOError as exc:  # the layout passed above: a tensor of another shape
        raise HFModelError(
            f"model.folder: {folder / CONFIG_FILE} does not describe the weights beside it ({exc}); use "
            "the config.json they were saved with"
        ) from None
    except MappingError as exc:
        raise HFModelError(f"model.folder: {exc}") from None
    return saved


def _folder_format(model: HFCausalLM, shapes: Mapping[str, tuple[int, ...]]) -> SavedFormat | None:
    """transformers' saved format of the model when the folder is closer to it than to the model's own
    keys (fewer tensors missing), else None."""
    layout = model.layout
    own_missing = sum(k not in shapes for k in layout.stored_keys)
    if not own_missing:
        return None
    tied = set(_tie_groups(layout)) | set(layout.tied)
    state = model.hf_model.state_dict()
    saved = saved_format(
        model.hf_model, {k: tuple(state[k].shape) for k in layout.stored_keys if k not in tied}
    )
    if not saved.converted:
        return None
    saved_missing = sum(k not in shapes for k in _folder_keys(layout, saved))
    return saved if saved_missing < own_missing else None


def _folder_keys(layout: HFStateLayout, saved: SavedFormat | None) -> set[str]:
    """The keys a folder of `layout` holds, in the model's own names or in the `saved` format."""
    if saved is None:
        return set(layout.stored_keys)
    return set(saved.keys) | set(_tie_groups(layout))


def _tie_groups(layout: HFStateLayout) -> dict[str, list[str]]:
    """Stored key → every key of that tied tensor (the stored one first)."""
    groups: dict[str, list[str]] = {}
    for alias, stored in layout.tied.items():
        groups.setdefault(stored, [stored]).append(alias)
    return groups


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f", ... ({len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else "")

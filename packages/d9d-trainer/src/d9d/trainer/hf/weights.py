"""How a Hugging Face folder's weights map onto `HFCausalLM`: the import and export mappers, and the
check of a folder against the model that refuses it before anything is allocated or written.

The model's names are Hugging Face's, so both mappers are identity but for what transformers itself
does on save and load: a tied tensor (`tie_word_embeddings`) is stored once under its first name and
read into all of them, and on load the folder keys transformers ignores are dropped (a stored copy
of a tied tensor, non-persistent buffers an old export saved, the class's own ignore patterns).
"""

from collections.abc import Iterable
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
from d9d.trainer.hf.errors import HFModelError
from d9d.trainer.hf.folder import CONFIG_FILE
from d9d.trainer.hf.model import HFCausalLM, HFStateLayout

__all__ = ["check_folder_weights", "export_mapper", "import_mapper"]

#: How many keys a message lists before "...".
_SHOWN = 4


def export_mapper(layout: HFStateLayout) -> StateMapper:
    """The model's state-dict keys → a Hugging Face folder's: identity, each tied tensor stored once."""
    groups = _tie_groups(layout)
    parts: list[StateMapper] = [Deduplicate(keys, stored) for stored, keys in groups.items()]
    parts.extend(Identity(key) for key in layout.stored_keys if key not in groups)
    return Parallel(parts)


def import_mapper(layout: HFStateLayout, source_keys: Iterable[str]) -> StateMapper:
    """A Hugging Face folder's keys (`source_keys`) → the model's: identity, each tied tensor read once
    into all its names, and the folder keys transformers ignores on load dropped unread."""
    groups = _tie_groups(layout)
    parts: list[StateMapper] = [Duplicate(stored, keys) for stored, keys in groups.items()]
    parts.extend(Identity(key) for key in layout.stored_keys if key not in groups)
    read = set(layout.stored_keys)
    ignored = sorted(k for k in source_keys if k not in read and (k in layout.tied or layout.is_ignorable(k)))
    if ignored:
        parts.append(Drop(ignored))
    return Parallel(parts)


def check_folder_weights(model: HFCausalLM, folder: Path) -> None:
    """Refuse a folder whose weights do not fit the model its config.json builds, reading no tensor.

    `model` may be on the meta device. The same checks run again when the trainer loads the folder.

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
    extra = sorted(k for k in shapes if k not in set(layout.keys) and not layout.is_ignorable(k))
    if extra:
        raise HFModelError(
            f"model.folder: {folder} holds {len(extra)} tensors that {described} does not have "
            f"({_listed(extra)}); the weights are of another model: use the config.json they were saved with"
        )
    missing = sorted(k for k in layout.stored_keys if k not in shapes)
    if missing:
        raise HFModelError(
            f"model.folder: {folder} lacks {len(missing)} tensors of {described} ({_listed(missing)}); "
            "the folder is incomplete or of another model: copy the missing weights in, or use the "
            "config.json they were saved with"
        )
    try:
        check_safetensors(model, folder, mapper=import_mapper(layout, shapes))
    except SafetensorsIOError as exc:  # the layout passed above: a tensor of another shape
        raise HFModelError(
            f"model.folder: {folder / CONFIG_FILE} does not describe the weights beside it ({exc}); use "
            "the config.json they were saved with"
        ) from None
    except MappingError as exc:
        raise HFModelError(f"model.folder: {exc}") from None


def _tie_groups(layout: HFStateLayout) -> dict[str, list[str]]:
    """Stored key → every key of that tied tensor (the stored one first)."""
    groups: dict[str, list[str]] = {}
    for alias, stored in layout.tied.items():
        groups.setdefault(stored, [stored]).append(alias)
    return groups


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f", ... ({len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else "")

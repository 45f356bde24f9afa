"""What the job's dataset sections say without loading data: a key as set or as its provider's default."""

import dataclasses
from typing import Any

import msgspec

from d9d.trainer.job.resolve import ResolvedJob

__all__ = ["configured_value", "packing_keys"]


def configured_value(job: ResolvedJob, role: str, key: str) -> tuple[Any, str]:
    """The value of `key` in the `role` ("dataset", "eval_dataset") section as the config tells it
    without loading data, and from where: set in the config, else the default of that field of the
    provider's `config_type`; (None, "") when neither has it."""
    config = job.config
    section, spec = {
        "dataset": (config.dataset, config.providers.dataset),
        "eval_dataset": (config.eval_dataset, config.providers.eval_dataset),
    }[role]
    if isinstance(section, dict) and key in section:
        return section[key], f"{role}.{key}"
    converted = job.sections.get(role)
    if isinstance(converted, msgspec.Struct) or _is_dataclass_instance(converted):
        fields = msgspec.to_builtins(converted)
        if key in fields:
            return fields[key], f"the {key} default of providers.{role} ({spec})"
    return None, ""


#: The dataset config keys that pack documents (a document mask in every batch).
_PACKING_KEYS = ("pack", "document_masking")


def packing_keys(job: ResolvedJob) -> list[str]:
    """The dataset keys of `_PACKING_KEYS` that the config (or its provider's default) sets true."""
    return [key for key in _PACKING_KEYS if configured_value(job, "dataset", key)[0] is True]


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)

"""A local Hugging Face model folder: its config.json read into the transformers class that builds it.

Every refusal names the file and the fix in one line, before any model, process-group state or file
of the job exists. Nothing is downloaded: the folder is read as it is (`local_files_only`).
"""

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, PretrainedConfig, PreTrainedModel

from d9d.mesh import first_line
from d9d.trainer.hf.errors import HFModelError

__all__ = [
    "CONFIG_FILE",
    "HFFolder",
    "attention_implementation",
    "exported_config",
    "quiet_transformers",
    "read_folder",
]

CONFIG_FILE = "config.json"
#: Files besides the weights that an export copies as they are, so the folder stays a whole HF model.
COPIED_FILES = ("generation_config.json",)
_FIX_FOLDER = "point model.folder (relative to the config file) to a Hugging Face model folder"


@dataclass(frozen=True)
class HFFolder:
    """A model folder as transformers reads it.

    Attributes:
        path: the folder.
        config: its config.json as transformers' config class of the architecture.
        model_class: the `AutoModelForCausalLM` class of that config (e.g. `LlamaForCausalLM`).
    """

    path: Path
    config: PretrainedConfig
    model_class: type[PreTrainedModel]

    @property
    def model_type(self) -> str:
        """The architecture's `model_type` (e.g. "llama")."""
        return str(self.config.model_type)

    def copied_files(self) -> dict[str, str]:
        """The texts of `COPIED_FILES` the folder has (file name → content)."""
        return {
            name: (self.path / name).read_text(encoding="utf-8")
            for name in COPIED_FILES
            if (self.path / name).is_file()
        }


def read_folder(path: Path) -> HFFolder:
    """The folder's config.json and its causal-LM class.

    Raises:
        HFModelError: the folder or its config.json is missing or unreadable, needs remote code, or
            names an architecture transformers has no causal LM of.
    """
    config_file = path / CONFIG_FILE
    if not path.is_dir():
        raise HFModelError(f"model.folder: {path} is not a directory; {_FIX_FOLDER}")
    if not config_file.is_file():
        raise HFModelError(
            f"model.folder: {path} has no {CONFIG_FILE}; {_FIX_FOLDER} (config.json and its *.safetensors)"
        )
    raw = _read_json(config_file)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise HFModelError(f"{config_file} has no model_type; use the config.json the model was saved with")
    if "auto_map" in raw:
        raise HFModelError(
            f"{config_file} asks for the model's own modeling code (auto_map: trust_remote_code), which "
            "d9d does not run; use a model whose architecture transformers ships"
        )
    try:
        with quiet_transformers():  # its warnings about the file would be lines beside our one
            config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise HFModelError(
            f"{config_file}: transformers {transformers.__version__} cannot read it (model_type "
            f"{model_type!r}: {first_line(exc)}); upgrade transformers or fix the file"
        ) from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise HFModelError(
            f"{config_file}: model_type {model_type!r} has no causal LM in transformers "
            f"{transformers.__version__} (AutoModelForCausalLM cannot build it); the Hugging Face backend "
            "trains causal LMs only"
        )
    return HFFolder(path=path, config=config, model_class=MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own log output at error level while the block runs (its warnings about a config,
    e.g. an unknown rope_type, would print beside the one line d9d gives for the same problem)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def attention_implementation(
    folder: HFFolder, asked: Literal["auto", "sdpa", "eager"], kernel: str = "auto"
) -> str:
    """The attention implementation to build with: `asked`, or for `auto` sdpa where the class has it;
    `kernel` (`trainer.attention.backend`) other than auto maps to transformers' own: flex to
    `flex_attention`, an SDPA kernel to `sdpa` (the trainer restricts SDPA to it around every step).

    Raises:
        HFModelError: sdpa or flex was asked of an architecture that has none, or `model.attention`
            names another implementation than the kernel needs.
    """
    has_sdpa = bool(getattr(folder.model_class, "_supports_sdpa", False))
    if kernel != "auto":
        return _kernel_implementation(folder, asked, kernel, has_sdpa)
    if asked == "auto":
        return "sdpa" if has_sdpa else "eager"
    if asked == "sdpa" and not has_sdpa:
        raise HFModelError(
            f"model.attention: sdpa, but {folder.model_class.__name__} has no sdpa attention in transformers "
            f"{transformers.__version__}; set model.attention: eager (or auto)"
        )
    return asked


def _kernel_implementation(folder: HFFolder, asked: str, kernel: str, has_sdpa: bool) -> str:
    """transformers' implementation for `trainer.attention.backend: kernel` (flex or an SDPA kernel)."""
    name = folder.model_class.__name__
    wanted = "flex_attention" if kernel == "flex" else "sdpa"
    if asked not in ("auto", wanted):
        raise HFModelError(
            f"model.attention: {asked}, but trainer.attention.backend: {kernel} runs through transformers' "
            f"{wanted} attention; set model.attention: auto (or trainer.attention.backend: auto)"
        )
    supported = (
        bool(getattr(folder.model_class, "_supports_flex_attn", False)) if kernel == "flex" else has_sdpa
    )
    if not supported:
        raise HFModelError(
            f"trainer.attention.backend: {kernel}, but {name} has no {wanted} attention in transformers "
            f"{transformers.__version__}; set trainer.attention.backend: auto"
        )
    return wanted


def exported_config(config: PretrainedConfig, architecture: str) -> str:
    """The config.json of an export: `config` as transformers saves it, naming the class and the
    float32 the weights are written in (so `from_pretrained` loads them as trained); a classifier's
    with its `num_labels`, label names and `pad_token_id` always written."""
    config = copy.deepcopy(config)
    config.architectures = [architecture]
    config.dtype = torch.float32
    if not architecture.endswith("ForSequenceClassification"):
        return config.to_json_string()
    written = json.loads(config.to_json_string())  # transformers leaves out what equals its defaults
    labels = {str(i): name for i, name in sorted(config.id2label.items())}
    written |= {"num_labels": len(labels), "id2label": labels, "label2id": config.label2id}
    written["pad_token_id"] = config.pad_token_id
    return json.dumps(written, indent=2, sort_keys=True) + "\n"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise HFModelError(f"{path} is not valid JSON ({exc}); restore the model's config.json") from None
    if not isinstance(value, dict):
        raise HFModelError(f"{path} must hold a JSON object; restore the model's config.json")
    return value

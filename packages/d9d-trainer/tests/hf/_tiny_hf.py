"""Tiny random Hugging Face models (built by transformers from its own config classes, nothing
downloaded), saved as model folders, and the d9d job that trains one through the HF backend."""

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import transformers

from d9d.trainer.providers import BuildDatasetResult

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB = 96
SEQ = 16
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
#: DeepSeek-V3 in small: multi-head latent attention (low-rank q and kv), one dense layer, then an MoE
#: layer of 4 routed experts (top 2, biased grouped routing) and a shared one; its folder holds one
#: weight per expert, as transformers saves it.
_DEEPSEEK_V3 = {
    **_COMMON,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
}
#: model_type → its transformers config: one of each family the tests cover (tied: gemma2, gemma3_text).
ARCHITECTURES: dict[str, Any] = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, head_dim=8),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**_COMMON, head_dim=8),
    "phi3": lambda: transformers.Phi3Config(**_COMMON),
    "olmo2": lambda: transformers.Olmo2Config(**_COMMON),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**_DEEPSEEK_V3),
}
#: Families other tests add: the tensor-parallel ones (per-head q/k norms without Gemma's scaling;
#: sliding-window code) and an MoE folder whose experts transformers saves under another module name.
MORE_ARCHITECTURES: dict[str, Any] = {
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON),
    "mistral": lambda: transformers.MistralConfig(**_COMMON),
    "mixtral": lambda: transformers.MixtralConfig(**_COMMON, num_local_experts=4),
}


def save_tiny(
    model_type: str,
    folder: Path,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """A random tiny model of `model_type` saved by transformers into `folder` (fp32 safetensors);
    `config`: attributes of its transformers config to set (e.g. attention_dropout)."""
    torch.manual_seed(seed)
    hf_config = {**ARCHITECTURES, **MORE_ARCHITECTURES}[model_type]()
    for key, value in (config or {}).items():
        setattr(hf_config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def load_hf(folder: Path) -> Any:
    """`AutoModelForCausalLM.from_pretrained(folder)` in float32, in eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logits(folder: Path, adapter: Path | None = None) -> torch.Tensor:
    """transformers' logits of the folder's model (with PEFT adapters from `adapter`) on `probe_batch`."""
    model = load_hf(folder)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    ids, positions = probe_batch()
    with torch.no_grad():  # without a cache, as in training: transformers then keeps the documents apart
        return model(input_ids=ids, position_ids=positions, use_cache=False).logits


def model_logits(model: torch.nn.Module) -> torch.Tensor:
    """A trained model's logits on `probe_batch` (in eval mode, back to training after)."""
    ids, positions = probe_batch()
    model.eval()
    with torch.no_grad():
        logits = model(ids, position_ids=positions).detach().clone()
    model.train()
    return logits


def train(config: dict[str, Any], export_dir: Path) -> dict[str, Any]:
    """One run (one process, or one rank of several): logits after the import and after training,
    losses, grad norms, full weights, the model's state-dict keys; the export written to `export_dir`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from d9d.trainer import Trainer

    with Trainer.from_config(config) as trainer:
        trainer.resume()  # a fresh run: the folder's weights (train() finds no checkpoint and reads them again)
        imported = model_logits(trainer.model)
        result = trainer.train()
        trained = model_logits(trainer.model)
        trainer.export(export_dir)
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        metrics = trainer.run_dir / "metrics.jsonl"
        norms = [json.loads(line)["grad_norm"] for line in metrics.read_text().splitlines()]
        return {
            "imported": imported,
            "trained": trained,
            "losses": result.losses,
            "grad_norms": norms,
            "weights": {name: t.detach().cpu().clone() for name, t in state.items()},
            "keys": list(trainer.model.state_dict()),
            # the parameters split over a mesh axis (tensor parallel), with their local shapes
            "split": {
                name: tuple(p.to_local().shape)
                for name, p in trainer.model.named_parameters()
                if any(type(pl).__name__ == "Shard" for pl in getattr(p, "placements", ()))
            },
            "units": fsdp_units(trainer.model),
        }


def fsdp_units(model: torch.nn.Module) -> list[set[str]]:
    """The parameter names of each FSDP2 unit of `model` (none on one process)."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): n for n, p in model.named_parameters()}
    groups = []  # a unit of several modules is found at each of them: once
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is not None and all(group is not g for g in groups):
            groups.append(group)
    return [{names[id(p.sharded_param)] for p in group.fsdp_params} for group in groups]


def max_rel(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two equally long lists of numbers."""
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True))


def probe_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed (input_ids, position_ids) with two packed documents per row, for comparing logits."""
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    positions = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).expand(2, SEQ)
    return ids, positions


class PackedTokensConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    samples: int = 32
    seq_len: int = SEQ
    vocab: int = VOCAB


class PackedTokens(torch.utils.data.Dataset):
    """Rows of two packed documents (lengths 10 and 6), each a learnable +1 sequence, with positions
    restarting per document, as d9d.data's packed datasets yield them."""

    def __init__(self, config: PackedTokensConfig) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(3, config.vocab, (config.samples, 1), generator=g)
        self.tokens = 3 + (start + torch.arange(config.seq_len + 1)) % (config.vocab - 3)
        first = 10
        self.documents = torch.cat([torch.zeros(first), torch.ones(config.seq_len - first)]).long()
        self.positions = torch.cat([torch.arange(first), torch.arange(config.seq_len - first)])

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.tokens[i, 1:].clone()
        labels[9] = -100  # the first document's last token does not predict the second's first
        return {
            "input_ids": self.tokens[i, :-1],
            "labels": labels,
            "position_ids": self.positions,
            "document_ids": self.documents,
        }


class PackedTokensProvider:
    config_type = PackedTokensConfig

    def __init__(self, config: PackedTokensConfig) -> None:
        self.config = config

    def build_dataset(self, context: Any) -> BuildDatasetResult:
        return BuildDatasetResult(dataset=PackedTokens(self.config), seq_len=self.config.seq_len)


def hf_job(
    folder: Path,
    save_dir: Path,
    *,
    name: str = "hf",
    steps: int = 3,
    trainer: dict[str, Any] | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """A job training the folder's model with the HF backend: SGD and no clipping, so runs on other
    meshes agree tightly (no second moment amplifies reduction-order noise). `trainer` adds keys to
    the trainer: section; the other keyword arguments are whole sections."""
    config: dict[str, Any] = {
        "providers": {
            "model": "d9d.trainer.hf:HFCausalLMProvider",
            "dataset": f"{__name__}:PackedTokensProvider",
        },
        "model": {"folder": str(folder)},
        "data": {"global_batch_size": 8, "microbatch_size": 2, "seed": 1},
        "trainer": {
            "run": {"name": name},
            "schedule": {"total_steps": steps},
            "checkpointing": {"save_dir": str(save_dir), "period_steps": 0},
            "logging": {"period_steps": 1},
            "gradient_clipping": {"max_norm": None},
            **(trainer or {}),
        },
        "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.0},
        "lr_scheduler": {"name": "constant", "warmup_steps": 0},
    }
    config.update(sections)
    return config


class PlainTokens(PackedTokens):
    """The same rows as one document each (no position or document ids): what context parallelism takes."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:].clone()}


class PlainTokensProvider(PackedTokensProvider):
    def build_dataset(self, context: Any) -> BuildDatasetResult:
        return BuildDatasetResult(dataset=PlainTokens(self.config), seq_len=self.config.seq_len)

"""d9d.trainer: the job config, the `Trainer` that runs a job, and the built-in providers.

    python train.py config.yaml            # train.py calls d9d.trainer.main()

A job names its providers by import path in `providers:`; the contract they implement is
`d9d.trainer.providers`. `d9d.trainer.planning.plan_job` decides what the job builds (mesh layout,
precision, batching, pipeline stages, sequence length, memory) from the config and the providers'
declared abilities, and the trainer builds from that plan: the model on the meta device, parallelized
by the model provider, materialized and initialized identically on any mesh; then it trains with
loss-weighted gradient accumulation, checkpoints, resumes and exports.

A fine-tune or a pre-training run needs no Python file: the built-in providers train the model d9d
ships (`ReferenceModelProvider`, `d9d.trainer.models`) or a Hugging Face folder (`HFModelProvider`)
on conversations (`ChatDatasetProvider`), preference pairs (`PreferenceDatasetProvider`), text
(`TextDatasetProvider`) or prepared folders (`PreparedDataProvider`).

The names below are the whole public face, listed once. They load on first use (PEP 562), so
importing one that needs no torch (`read_metrics`) does not import torch: `d9d metrics` stays fast.
The Hugging Face backend, an optional extra, is its own face: `d9d.trainer.hf:HFCausalLMProvider`.

The package is laid out by lifecycle: `job/` (reading, checking, resolving a config), `planning/`,
`build/` (the model, its starting weights, export), `step/`, `run/` (the loop and its cadences),
`observe/` (records, trackers, timing), `faults/`; at the top only what a user touches.
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_face

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
    from d9d.trainer.build.materialize import materialize_and_initialize
    from d9d.trainer.builtins.classification import SequenceClassificationConfig, SequenceClassificationTask
    from d9d.trainer.builtins.data import AutoDataProviderFactory
    from d9d.trainer.builtins.datasets import (
        ChatDatasetConfig,
        ChatDatasetProvider,
        PreferenceDatasetConfig,
        PreferenceDatasetProvider,
        PromptDatasetConfig,
        PromptDatasetProvider,
        TextDatasetConfig,
        TextDatasetProvider,
    )
    from d9d.trainer.builtins.embedding import EmbeddingConfig, EmbeddingTask
    from d9d.trainer.builtins.grpo import GRPOConfig, GRPOTask
    from d9d.trainer.builtins.hf_folder import HFModelConfig, HFModelProvider
    from d9d.trainer.builtins.optim import BuiltinLRSchedulerProvider, BuiltinOptimizerProvider
    from d9d.trainer.builtins.preference import PreferenceConfig, PreferenceTask
    from d9d.trainer.builtins.prepared_data import MixtureSource, PreparedDataConfig, PreparedDataProvider
    from d9d.trainer.builtins.reference_model import ReferenceModelProvider
    from d9d.trainer.builtins.task import CausalLMTask
    from d9d.trainer.callbacks import Callback, RunControl
    from d9d.trainer.config.base import ConfigPath
    from d9d.trainer.config.job import JobConfig
    from d9d.trainer.entry import main, run_job
    from d9d.trainer.errors import ConfigError, TrainingError
    from d9d.trainer.generation import SamplingConfig, generate
    from d9d.trainer.job.load import LoadedJob, load_job_config
    from d9d.trainer.job.resolve import ResolvedJob, resolve_job
    from d9d.trainer.observe.metrics_file import read_metrics
    from d9d.trainer.results import EvalResult, TrainResult
    from d9d.trainer.trainer import Trainer

__all__, __getattr__, __dir__ = lazy_face(__name__, globals(), subfaces=("planning", "providers"))

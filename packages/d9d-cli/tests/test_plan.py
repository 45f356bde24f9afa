"""`d9d plan`: layout, microbatches, context parallelism, pipeline stages and bubble, memory estimate
and launch command; every way it refuses."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import job_config, run_cli_concurrently, write_job

from d9d.cli import cli
from d9d.cli.commands._launch import launch_command
from d9d.cli.commands._text import format_size
from d9d.cli.commands.init import d9d_invocation
from d9d.mesh import DistributedContext, MeshConfig, axis_groups
from d9d.trainer import load_job_config, resolve_job
from d9d.trainer.planning import estimate_activations, estimate_memory

#: A tiny causal LM whose attention supports context parallelism (as the quickstart's does), and
#: dataset providers whose config_type has a seq_len default (16) or none at all.
CP_PROVIDERS = '''
"""Tiny attention LM with context-parallel support, and datasets (written by d9d-cli tests)."""

from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

from d9d.parallel import parallelize_context_parallel, parallelize_hsdp, parallelize_tensor_parallel
from d9d.trainer.providers import BuildDatasetResult, InitializeModelStageResult, PrepareExportModelStageResult


class AttentionLMConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    vocab: int = 32
    hidden: int = 16
    heads: int = 2
    layers: int = 2


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.heads = heads
        self.context_parallel: Any = None  # set by parallelize_context_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        if self.context_parallel is not None:
            y = self.context_parallel.attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, h))


class AttentionLM(nn.Module):
    def __init__(self, config: AttentionLMConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.blocks = nn.ModuleList(Attention(config.hidden, config.heads) for _ in range(config.layers))
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class AttentionModelProvider:
    config_type = AttentionLMConfig

    def __init__(self, config: AttentionLMConfig) -> None:
        self.config = config

    def initialize_model_stage(self, context: Any) -> InitializeModelStageResult:
        return InitializeModelStageResult(model=AttentionLM(self.config))

    def parallelize_model_stage(self, context: Any) -> None:
        if context.mesh is not None:  # tensor parallel: each projection's output gathered whole
            names = [f"blocks.{i}.{p}" for i in range(len(context.model.blocks)) for p in ("qkv", "out")]
            plan = {name: ColwiseParallel(output_layouts=Replicate()) for name in names}
            parallelize_tensor_parallel(context.model, context.mesh, plan)
        parallelize_context_parallel(context.model, context.mesh)
        parallelize_hsdp(context.model, context.mesh, blocks=list(context.model.blocks), precision=context.precision)

    def prepare_export_model_stage(self, context: Any) -> PrepareExportModelStageResult:
        return PrepareExportModelStageResult(mapper=None)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, samples: int, seq_len: int) -> None:
        self.tokens = torch.arange(samples * (seq_len + 1)).view(samples, -1) % 32
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class SequencesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    samples: int = 64
    seq_len: int = 16


class SequencesProvider:
    config_type = SequencesConfig

    def __init__(self, config: SequencesConfig) -> None:
        self.config = config

    def build_dataset(self, context: Any) -> BuildDatasetResult:
        dataset = Tokens(self.config.samples, self.config.seq_len)
        return BuildDatasetResult(dataset=dataset, seq_len=self.config.seq_len)  # checked against cp


class OpaqueConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    samples: int = 64


class OpaqueProvider:
    """Its sequence length is known only once the data is loaded."""

    config_type = OpaqueConfig

    def __init__(self, config: OpaqueConfig) -> None:
        self.config = config

    def build_dataset(self, context: Any) -> BuildDatasetResult:
        return BuildDatasetResult(dataset=Tokens(self.config.samples, 12))
'''


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return write_job(tmp_path_factory.mktemp("plan"))


@pytest.fixture(scope="module")
def cp_config(tmp_path_factory):
    """A job whose model supports context parallelism; dataset.seq_len is not set (the provider's 16)."""
    directory = tmp_path_factory.mktemp("plan_cp")
    (directory / "cp_job.py").write_text(CP_PROVIDERS, encoding="utf-8")
    providers = {"model": "cp_job.py:AttentionModelProvider", "dataset": "cp_job.py:SequencesProvider"}
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(job_config(providers=providers)), encoding="utf-8")
    return path


def _lines(output: str, prefix: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if line.strip().startswith(prefix)]


def _launch(output: str) -> str:
    """The launch command: the line after `launch (...)`, without the `on every node:` prefix."""
    lines = output.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("launch (")]
    return lines[at + 1].strip().removeprefix("on every node: ")


def _mesh_sets(**degrees: int) -> list[str]:
    return [arg for key, value in degrees.items() for arg in ("--set", f"mesh.{key}={value}")]


def test_launch_command_for_one_process_many_processes_and_many_nodes():
    assert launch_command("c.yaml", [], nnodes=1, nproc_per_node=1) == "d9d train c.yaml"
    one_node = launch_command("my c.yaml", ["a.b=1"], nnodes=1, nproc_per_node=4)
    assert shlex.split(one_node) == [
        "torchrun", "--nproc-per-node", "4", "-m", "d9d.cli", "train", "my c.yaml", "--set", "a.b=1",
    ]  # fmt: skip
    nodes = shlex.split(launch_command("c.yaml", [], nnodes=2, nproc_per_node=8))
    assert nodes[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"]
    assert "--rdzv-endpoint" in nodes and nodes[-3:] == ["d9d.cli", "train", "c.yaml"]


def test_launch_command_runs_d9d_and_torchrun_from_the_same_environment():
    script = "/opt/my env/bin/d9d"  # e.g. under `uv run`: the environment's script by its path
    assert shlex.split(launch_command("c.yaml", [], nnodes=1, nproc_per_node=1, d9d=shlex.quote(script))) == [
        script, "train", "c.yaml",
    ]  # fmt: skip
    many = shlex.split(launch_command("c.yaml", [], nnodes=2, nproc_per_node=2, d9d=shlex.quote(script)))
    assert many[0] == "/opt/my env/bin/torchrun" and many[-3:] == ["d9d.cli", "train", "c.yaml"]
    module = launch_command("c.yaml", [], nnodes=1, nproc_per_node=2, d9d="/usr/bin/python3 -m d9d.cli")
    assert shlex.split(module)[:4] == ["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc-per-node"]


def test_plan_prints_layout_batches_memory_and_command(runner, config):
    sets = ["--set", "mesh.data_parallel_shard=2", "--set", "mesh.tensor_parallel=2"]
    result = runner.invoke(cli, ["plan", str(config), "--world-size", "4", *sets])
    assert result.exit_code == 0, result.output
    out = result.output
    mesh = MeshConfig(data_parallel_shard=2, tensor_parallel=2)
    tp_groups = axis_groups(mesh, "dense", "tp")
    assert f"[{tp_groups[0][0]},{tp_groups[0][1]}]" in out
    # data: 8 samples over 2 DP ranks in microbatches of 2 → 2 microbatches per rank
    assert _lines(out, "data:") == [
        "data: global batch 8 = 2 data-parallel ranks × 2 microbatches of 2 per step"
    ]
    # TinyLM(vocab 32, hidden 16, 2 layers): embed 32·16 + 2·(16·16+16) + head 16·32
    n_params = 32 * 16 + 2 * (16 * 16 + 16) + 16 * 32
    assert f"{n_params:,} parameters" in out
    per_rank = estimate_memory(
        n_params * 4,
        n_params * 4,
        pipeline_parallel=1,
        data_parallel_shard=2,
        context_parallel=1,
        tensor_parallel=2,
        optimizer_states=2,
    )
    assert "1/4 of the model" in out
    expected = launch_command(str(config), sets[1::2], nnodes=1, nproc_per_node=4, d9d=d9d_invocation())
    assert _launch(out) == expected
    assert _lines(out, "parameters")[0].split(None, 1)[1] == format_size(per_rank.params)
    # TokensProvider's config_type gives seq_len 8 (the config does not set dataset.seq_len)
    job = resolve_job(load_job_config(config, sets[1::2]))
    acts = _activations(job, seq_len=8, microbatch_size=2)
    assert "one microbatch of 2 × 8 tokens" in _lines(out, "activations")[0]
    assert _lines(out, "total")[0].split(None, 1)[1] == format_size(per_rank.total + acts.plain)


def test_bfloat16_optimizer_states_count_2_bytes_an_element_and_the_plan_says_so(runner, config):
    base = ["plan", str(config), "--world-size", "2", "--set", "mesh.data_parallel_shard=2"]
    n_params = 32 * 16 + 2 * (16 * 16 + 16) + 16 * 32  # TinyLM, as above; AdamW: 2 states
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        result = runner.invoke(cli, [*base, "--set", f"optimizer.state_dtype={dtype}"])
        assert result.exit_code == 0, result.output
        (line,) = _lines(result.output, "optimizer ")
        assert line.split()[1:3] == format_size(2 * n_params * size // 2).split(), line  # over dp_shard 2
        assert line.endswith(f"(AdamW: exp_avg + exp_avg_sq, in {dtype})"), line
        (precision,) = _lines(result.output, "precision:")
        assert f"master weights float32, optimizer states {dtype};" in precision


def test_plan_without_a_size_plans_for_the_mesh(runner, config):
    result = runner.invoke(cli, ["plan", str(config), "--set", "mesh.data_parallel_replicate=2"])
    assert result.exit_code == 0, result.output
    overrides = ["mesh.data_parallel_replicate=2"]
    assert _launch(result.output) == launch_command(
        str(config), overrides, nnodes=1, nproc_per_node=2, d9d=d9d_invocation()
    )


def test_plan_for_several_nodes(runner, config):
    args = [
        "plan",
        str(config),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--set",
        "mesh.data_parallel_shard=4",
    ]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "2 nodes × 2 processes" in result.output
    assert "--nnodes 2 --nproc-per-node 2" in result.output


def test_mismatched_world_size_is_one_line(runner, config):
    result = runner.invoke(
        cli, ["plan", str(config), "--world-size", "8", "--set", "mesh.data_parallel_shard=2"]
    )
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "8" in lines[0] and "needs 2" in lines[0] and "mesh.data_parallel_shard=8" in lines[0]


def test_mismatched_nodes_name_both_numbers(runner, config):
    result = runner.invoke(cli, ["plan", str(config), "--nnodes", "2", "--nproc-per-node", "3"])
    assert result.exit_code == 2
    assert "--nnodes 2 × --nproc-per-node 3 gives 6 processes" in result.stderr


@pytest.mark.parametrize(
    "args",
    [["--world-size", "2", "--nnodes", "2"], ["--nnodes", "2"]],
    ids=["size-and-nodes", "nodes-alone"],
)
def test_conflicting_size_options_are_usage_errors(runner, config, args):
    result = runner.invoke(cli, ["plan", str(config), *args])
    assert result.exit_code == 2
    assert "--nnodes" in result.stderr


def test_batch_that_does_not_divide_is_one_line(runner, config):
    result = runner.invoke(cli, ["plan", str(config), "--set", "mesh.data_parallel_shard=3"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: data.global_batch_size=8")
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_config_and_bad_path(runner, config, tmp_path):
    bad_key = runner.invoke(cli, ["plan", str(config), "--set", "trainer.bogus=1"])
    assert bad_key.exit_code == 2 and "unknown key trainer.bogus" in bad_key.stderr
    missing = runner.invoke(cli, ["plan", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "no such config file" in missing.stderr
    bad_provider = runner.invoke(cli, ["plan", str(config), "--set", "providers.model=tiny_job.py:Nope"])
    assert bad_provider.exit_code == 2 and "Nope" in bad_provider.stderr
    bad_type = runner.invoke(cli, ["plan", str(config), "--set", "data.global_batch_size=abc"])
    assert bad_type.exit_code == 2 and "data.global_batch_size: Expected int" in bad_type.stderr
    assert "Traceback" not in bad_key.output + missing.output + bad_provider.output + bad_type.output


def test_debug_shows_the_exception(runner, config):
    result = runner.invoke(cli, ["--debug", "plan", str(config), "--world-size", "3"])
    assert result.exit_code != 0
    assert type(result.exception).__name__ == "CliError"


def test_plan_in_a_subprocess(config, tmp_path):
    ok, bad, missing = run_cli_concurrently(
        ["plan", str(config), "--world-size", "2", "--set", "mesh.data_parallel_shard=2"],
        ["plan", str(config), "--world-size", "3"],
        ["plan", str(tmp_path / "nope.yaml")],
    )
    assert ok.returncode == 0, ok.stderr
    assert "torchrun --nproc-per-node 2 -m d9d.cli train" in ok.stdout
    assert (
        missing.returncode == 2
        and missing.stderr.startswith("error: ")
        and "no such config" in missing.stderr
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: --world-size gives 3 processes")
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_plan_shows_precision_checkpointing_and_activations_with_and_without_it(runner, config):
    base = ["plan", str(config), "--seq-len", "64"]
    result = runner.invoke(cli, [*base, "--set", "trainer.activation_checkpointing.mode=full"])
    assert result.exit_code == 0, result.output
    out = result.output
    (precision,) = _lines(out, "precision:")
    assert "compute bfloat16 (auto: bfloat16 on CUDA, float32 on CPU), reduce float32" in precision
    (ac,) = _lines(out, "activation checkpointing:")
    assert ac.startswith("activation checkpointing: full")
    (acts,) = _lines(out, "activations")
    assert (
        "one microbatch of 2 × 64 tokens in bfloat16, the auto dtype on CUDA (a CPU run computes in float32"
        in acts
    )
    assert "checkpointing full" in acts
    fp32 = runner.invoke(cli, [*base, "--set", "trainer.precision.param_dtype=float32"])
    assert "in float32, checkpointing none" in _lines(fp32.output, "activations")[0]
    (total,) = _lines(out, "total")
    assert total.split()[1:] != _lines(fp32.output, "total")[0].split()[1:]  # activations count in the total
    per_op = runner.invoke(cli, [*base, "--set", "trainer.activation_checkpointing.mode=op"])
    (ac,) = _lines(per_op.output, "activation checkpointing:")
    assert ac.startswith("activation checkpointing: op (every block keeps its matmul and attention outputs")
    (acts,) = _lines(per_op.output, "activations")
    assert "checkpointing op; none: " in acts
    sizes = [_lines(o, "activations")[0].split()[1:3] for o in (result.output, per_op.output, fp32.output)]
    assert len({tuple(s) for s in sizes}) == 3, sizes  # op's own figure, neither full's nor none's


def test_plan_says_which_attention_kernel_and_refuses_what_cuda_cannot_run(runner, config):
    # `d9d plan` plans for CUDA: without a GPU here `auto` waits for the job's GPU and says its rule
    import torch

    base = ["plan", str(config), "--seq-len", "64"]
    (line,) = _lines(runner.invoke(cli, base).output, "attention:")
    assert line.startswith("attention: auto (decided at start from the GPU: cudnn on sm90/sm100") or (
        torch.cuda.is_available() and "auto on sm" in line
    ), line
    (line,) = _lines(
        runner.invoke(cli, [*base, "--set", "trainer.attention.backend=efficient"]).output, "attention:"
    )
    assert line == "attention: efficient (asked by trainer.attention.backend; SDPA runs only this kernel)"
    refused = runner.invoke(
        cli,
        [*base, "--set", "trainer.attention.backend=flash", "--set", "trainer.precision.param_dtype=float32"],
    )
    assert refused.exit_code == 2, refused.output
    assert refused.output.strip() == (
        "error: trainer.attention.backend: flash takes bfloat16/float16 only on CUDA, but the compute dtype is "
        "float32; set trainer.precision.param_dtype: bfloat16, or use efficient, math or auto"
    )


def test_plan_without_a_sequence_length_says_how_to_get_the_activation_estimate(runner, cp_config):
    opaque = ["--set", "providers.dataset=cp_job.py:OpaqueProvider"]  # no seq_len in its config_type
    result = runner.invoke(cli, ["plan", str(cp_config), *opaque])
    assert result.exit_code == 0, result.output
    (acts,) = _lines(result.output, "activations")
    assert "pass --seq-len" in acts and "neither dataset.seq_len nor" in acts


# ------------------------------------------------------------------------------ context parallelism


def test_plan_shows_the_cp_groups_and_each_ranks_share_of_a_sequence(runner, cp_config):
    sets = _mesh_sets(data_parallel_shard=2, context_parallel=2, tensor_parallel=2)
    result = runner.invoke(cli, ["plan", str(cp_config), "--world-size", "8", *sets])
    assert result.exit_code == 0, result.output
    out = result.output
    # rank = (dp · cp + c) · tp + t: a cp group is one (dp, tp) coordinate, in cp-rank order
    groups = [[(d * 2 + c) * 2 + t for c in range(2)] for d in range(2) for t in range(2)]
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups == axis_groups(
        MeshConfig(data_parallel_shard=2, context_parallel=2, tensor_parallel=2), "batch", "cp"
    )
    assert _lines(out, "cp groups") == ["cp groups (in cp-rank order): [0,2], [1,3], [4,6], [5,7]"]
    (context,) = _lines(out, "context parallel:")
    assert "cp 2" in context and "same samples" in context
    (share,) = _lines(out, "sequence per rank:")
    assert share == (
        "sequence per rank: 16 / 2 = 8 tokens (chunks r and 3−r of 4 for cp rank r, 4 tokens each; 16 from "
        "the seq_len default of providers.dataset (cp_job.py:SequencesProvider))"
    )
    # FSDP shards over dp_shard × cp: 1/(2·2·2) of the model per rank
    assert "1/8 of the model: pp 1 × dp_shard 2 × cp 2 × tp 2" in out
    (acts,) = _lines(out, "activations")
    assert "one microbatch of 2 × 8 tokens" in acts  # this rank's 8 of the 16 tokens
    (assumes,) = _lines(out, "activation estimate assumes:")
    assert "each rank holds 1/2 of the sequence, except the K/V that attention all-gathers" in assumes
    assert _lines(out, "attention balance") == []  # the rows are not packed
    assert "tensor parallel 2 as the model provider splits the model" in assumes


def test_plan_without_cp_shows_no_cp_section(runner, cp_config):
    result = runner.invoke(
        cli, ["plan", str(cp_config), "--world-size", "2", *_mesh_sets(data_parallel_shard=2)]
    )
    assert result.exit_code == 0, result.output
    assert _lines(result.output, "context parallel") == []
    assert "1/2 of the model: pp 1 × dp_shard 2 × cp 1 × tp 1" in result.output


@pytest.mark.parametrize(
    ("args", "source"),
    [
        (["--set", "dataset.seq_len=64"], "64 from dataset.seq_len"),
        (["--seq-len", "64"], "64 from --seq-len"),
    ],
    ids=["config", "option"],
)
def test_sequence_per_rank_names_where_the_length_comes_from(runner, cp_config, args, source):
    result = runner.invoke(cli, ["plan", str(cp_config), *_mesh_sets(context_parallel=4), *args])
    assert result.exit_code == 0, result.output
    (share,) = _lines(result.output, "sequence per rank:")
    assert share.startswith(
        "sequence per rank: 64 / 4 = 16 tokens (chunks r and 7−r of 8 for cp rank r, 8 tokens"
    )
    assert share.endswith(f"{source})")
    assert "cp groups (in cp-rank order): [0..3]" in result.output


def test_sequence_per_rank_says_when_the_length_is_unknown(runner, cp_config):
    args = ["--set", "providers.dataset=cp_job.py:OpaqueProvider", *_mesh_sets(context_parallel=2)]
    result = runner.invoke(cli, ["plan", str(cp_config), *args])
    assert result.exit_code == 0, result.output
    (share,) = _lines(result.output, "sequence per rank:")
    assert share.startswith("sequence per rank: seq_len / 2 tokens (chunks r and 3−r of 4 for cp rank r)")
    assert "not known without loading data" in share and "pass --seq-len" in share


def test_the_plan_refuses_a_length_with_the_trainers_message(cp_config):
    """`d9d plan` (config only) and the trainer (the built dataset) plan with the same function: the
    dataset's length is refused with the same words whichever way it is known."""
    from d9d.parallel import SequenceLengthError
    from d9d.trainer.planning import plan_job
    from d9d.trainer.providers import BuildDatasetResult

    job = _resolved(cp_config, "dataset.seq_len=18", "mesh.context_parallel=2")
    built = BuildDatasetResult(dataset=[], seq_len=18)
    with DistributedContext.for_planning(job.config.mesh) as ctx:
        with pytest.raises(SequenceLengthError) as from_config:
            plan_job(job, ctx)
        with pytest.raises(SequenceLengthError) as from_dataset:
            plan_job(job, ctx, dataset=built)
    assert str(from_config.value) == str(from_dataset.value)
    assert str(from_config.value).startswith("the dataset's sequences have 18 tokens, not divisible by 2 × ")


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (
            ["--set", "dataset.seq_len=18", *_mesh_sets(context_parallel=2)],
            "the dataset's sequences have 18 tokens",
        ),
        (_mesh_sets(context_parallel=3), "the dataset's sequences have 16 tokens"),  # the provider's default
        (
            ["--seq-len", "10", *_mesh_sets(context_parallel=2)],
            "--seq-len gives 10 tokens, not divisible by 2 × ",
        ),
    ],
    ids=["dataset.seq_len", "provider-default", "option"],
)
def test_sequence_length_that_cp_cannot_split_is_one_line(runner, cp_config, args, start):
    result = runner.invoke(cli, ["plan", str(cp_config), *args])
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {start}")
    assert "mesh.context_parallel" in lines[0] and "multiple of" in lines[0]


def test_cp_with_a_model_without_cp_support_is_one_line(runner, config):
    result = runner.invoke(cli, ["plan", str(config), *_mesh_sets(context_parallel=2)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    # the trainer's own refusal of a model whose provider gave no module the cp group, word for word
    assert len(lines) == 1 and lines[0].startswith(
        "error: mesh.context_parallel=2 but the model provider's parallelize_model_stage gave no module the cp group"
    )
    assert "mesh.context_parallel: 1" in lines[0]


def _resolved(config: Path, *overrides: str):
    return resolve_job(load_job_config(config, list(overrides)))


def _activations(job, *, seq_len: int, microbatch_size: int):
    """The trainer's activation estimate of `job` in bfloat16, on rank 0 of a planning context."""
    from d9d.parallel import PrecisionConfig, resolve_precision

    bf16 = resolve_precision(PrecisionConfig(param_dtype="bfloat16"), "cpu")
    with DistributedContext.for_planning(job.config.mesh) as ctx:
        return estimate_activations(
            job, ctx, seq_len=seq_len, microbatch_size=microbatch_size, precision=bf16
        )


def test_activations_under_cp_are_the_local_sequence_plus_the_gathered_kv(cp_config):
    seq, microbatch, hidden, layers, bf16 = 32, 2, 16, 2, 2
    with_cp = _activations(
        _resolved(cp_config, "mesh.context_parallel=2"),
        seq_len=seq,
        microbatch_size=microbatch,
    )
    # (sharded like cp 2, so both run the same way; weights and their copies are not activations)
    sharded = _resolved(cp_config, "mesh.data_parallel_shard=2")
    half = _activations(sharded, seq_len=seq // 2, microbatch_size=microbatch)
    assert with_cp.tokens == half.tokens == f"{microbatch} × {seq // 2}"
    # Everything is the one-process figure at seq / cp tokens, plus, in every layer, K and V of the
    # whole sequence that attention all-gathers and keeps for backward, and the attention output: one
    # process feeds the kernel's own output (laid out [batch, seq, heads, dim]) to the output
    # projection as a view, cp joins its two chunks' outputs into a new tensor, which the projection
    # keeps beside them.
    gathered_kv = layers * 2 * microbatch * seq * hidden * bf16
    joined = layers * microbatch * (seq // 2) * hidden * bf16
    assert with_cp.plain == half.plain + gathered_kv + joined
    assert with_cp.full == half.full  # block inputs only: the gather is redone in the backward
    # the old estimate (the full sequence on one rank divided by cp, as if cp were tp) is not it
    whole = _activations(sharded, seq_len=seq, microbatch_size=microbatch)
    assert with_cp.plain != -(-whole.plain // 2)


def test_attention_is_counted_as_a_fused_kernel_linear_in_the_sequence(cp_config):
    job = _resolved(cp_config)
    plain = [_activations(job, seq_len=seq, microbatch_size=2).plain for seq in (64, 128, 256)]
    # affine in seq_len (a few scalars aside): no seq × seq matrix, which SDPA's math path on the
    # meta device would save
    assert plain[2] - plain[1] == 2 * (plain[1] - plain[0])


# ------------------------------------------------------------------------------ launch command


def test_printed_single_process_command_runs_from_a_shell_without_the_environment(cp_config, tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # e.g. the shell that typed `uv run d9d plan ...`
    env.pop("UV_RUN_RECURSION_DEPTH", None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    planned = subprocess.run(
        [sys.executable, "-m", "d9d.cli", "plan", str(cp_config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    command = shlex.split(_launch(planned.stdout))
    assert command[1:] == ["train", str(cp_config)] or command[1:4] == ["-m", "d9d.cli", "train"]
    ran = subprocess.run([*command, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "Run the job in CONFIG" in ran.stdout


# ------------------------------------------------------------------------------ pipeline parallelism

#: Appended to tiny_job.py: a model provider whose layers the trainer may split into stages, a task
#: without the pipeline methods and a data provider of its own (it decides the microbatch count).
PIPELINE_PROVIDERS = """

class PipelineModelProvider(TinyModelProvider):
    def pipeline_num_layers(self) -> int:
        return self.config.layers


class PlainTask:
    config_type = None

    def __init__(self, config: Any = None) -> None:
        del config

    def batch_weight(self, batch: Any) -> Any:
        return batch["labels"].numel()

    def compute_loss(self, context: Any) -> Any:
        raise NotImplementedError


class OwnData:
    config_type = None

    def __init__(self, config: Any = None) -> None:
        del config

    def build_data_provider(self, context: Any) -> Any:
        raise NotImplementedError
"""


@pytest.fixture(scope="module")
def pp_config(tmp_path_factory):
    """The tiny job with 4 layers, a model provider with pipeline_num_layers() and 8 samples in
    microbatches of 2 per step (4 microbatches per pipeline at dp 1)."""
    directory = tmp_path_factory.mktemp("plan_pp")
    providers = {"model": "tiny_job.py:PipelineModelProvider", "dataset": "tiny_job.py:TokensProvider"}
    path = write_job(directory, providers=providers, model={"layers": 4})
    with (directory / "tiny_job.py").open("a", encoding="utf-8") as file:
        file.write(PIPELINE_PROVIDERS)
    return path


def _pp_plan(runner, config: Path, schedule: str, *args: str):
    sets = ["--set", "mesh.pipeline_parallel=2", "--set", f"pipelining.schedule={schedule}", *args]
    return runner.invoke(cli, ["plan", str(config), "--world-size", "2", *sets])


def _trainer_layout_error(config: Path, *overrides: str) -> str:
    """The message the trainer's own plan (`plan_job` on rank 0 of the job's mesh) refuses this job with."""
    from d9d.trainer.planning import plan_job

    job = _resolved(config, *overrides)
    with DistributedContext.for_planning(job.config.mesh) as ctx, pytest.raises(Exception) as refused:
        plan_job(job, ctx)
    return str(refused.value)


def test_interleaved_1f1b_gives_each_pp_rank_two_looped_chunks_on_world_2(runner, pp_config):
    result = _pp_plan(runner, pp_config, "interleaved_1f1b")
    assert result.exit_code == 0, result.output
    out = result.output
    (head,) = _lines(out, "pipeline parallel:")
    assert head.startswith(
        "pipeline parallel: pp 2, schedule interleaved_1f1b, 2 × 2 = 4 stages, looped (stage s on pp rank s mod 2); "
        "4 layers split with the embedding and the head counted as 1 and 1 layers"
    )
    # the trainer's split (embedding and head weigh a layer each): stages hold 0, 1, 2, 1 layers
    assert _lines(out, "pp rank") == [
        "pp rank 0 (ranks [0]): stage 0: embedding; stage 2: layers 1..2",
        "pp rank 1 (ranks [1]): stage 1: layer 0; stage 3: layer 3 + head",
    ]
    from d9d.parallel.pipeline import PipelineConfig, plan_pipeline

    layout = plan_pipeline(4, 2, PipelineConfig("interleaved_1f1b"), n_microbatches=4)
    assert [[s.index for s in layout.stages_of_rank(r)] for r in (0, 1)] == [[0, 2], [1, 3]]
    # this provider builds the whole model for every stage, so the stages' forwards cannot chain
    (acts,) = _lines(out, "activations")
    assert "not estimated: the forward does not run on the meta device" in acts


def test_zbv_is_v_shaped_the_first_rank_holds_the_embedding_and_the_head(runner, pp_config):
    result = _pp_plan(runner, pp_config, "zbv", "--set", "mesh.data_parallel_shard=2", "--world-size", "4")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "4 stages, V-shaped (stages r and 3−r on pp rank r)" in _lines(out, "pipeline parallel:")[0]
    # pp is the outermost axis: pp rank 0 is global ranks 0 and 1
    assert _lines(out, "pp rank") == [
        "pp rank 0 (ranks [0,1]): stage 0: embedding; stage 3: layer 3 + head",
        "pp rank 1 (ranks [2,3]): stage 1: layer 0; stage 2: layers 1..2",
    ]
    # 8 samples over 2 dp ranks in microbatches of 2: m = 2 < 4 stages, too few for zero bubble
    (bubble,) = _lines(out, "bubble:")
    assert bubble.startswith("bubble: not ≈ 0: m=2 microbatches < 4 stages")


def test_single_stage_schedules_hold_one_chunk_per_rank(runner, pp_config):
    result = _pp_plan(runner, pp_config, "1f1b")
    assert result.exit_code == 0, result.output
    assert "2 stages, one per pp rank" in _lines(result.output, "pipeline parallel:")[0]
    assert _lines(result.output, "pp rank") == [
        "pp rank 0 (ranks [0]): stage 0: embedding + layers 0..1",
        "pp rank 1 (ranks [1]): stage 1: layers 2..3 + head",
    ]


def test_bubble_of_1f1b_and_interleaved_1f1b(runner, pp_config):
    # p = 2 ranks, m = 4 microbatches: 1F1B (p−1)/(m+p−1) = 1/5; interleaved, v = 2: (p−1)/(v·m+p−1) = 1/9
    bubbles = {
        schedule: _lines(_pp_plan(runner, pp_config, schedule).output, "bubble:")[0]
        for schedule in ("1f1b", "interleaved_1f1b")
    }
    assert bubbles["1f1b"].startswith(
        "bubble: 1/5 = 20.0% of the step's forward and backward time ((p−1)/(m+p−1) with p=2, v=1, m=4; 1F1B"
    )
    assert bubbles["interleaved_1f1b"].startswith(
        "bubble: 1/9 = 11.1% of the step's forward and backward time ((p−1)/(v·m+p−1) with p=2, v=2, m=4; "
        "interleaved 1F1B"
    )


def test_zbv_with_enough_microbatches_has_no_bubble(runner, pp_config):
    result = _pp_plan(runner, pp_config, "zbv")
    assert result.exit_code == 0, result.output
    assert _lines(result.output, "pp rank") == [
        "pp rank 0 (ranks [0]): stage 0: embedding; stage 3: layer 3 + head",
        "pp rank 1 (ranks [1]): stage 1: layer 0; stage 2: layers 1..2",
    ]
    (bubble,) = _lines(result.output, "bubble:")
    assert bubble.startswith("bubble: ≈ 0 of the step (m=4 ≥ p·v = 4 stages; ZB-V")
    (assumes,) = _lines(result.output, "bubble assumes:")
    assert "same time" in assumes and "input- and weight-gradient parts" in assumes


def test_a_data_provider_that_declares_no_batching_is_refused_under_pp_like_the_trainer(runner, pp_config):
    sets = ["mesh.pipeline_parallel=2", "providers.data=tiny_job.py:OwnData"]
    result = runner.invoke(cli, ["plan", str(pp_config), *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 2 and result.stdout == ""
    expected = _trainer_layout_error(pp_config, *sets)
    assert "declares no batching" in expected and "batching(mesh)" in expected
    assert result.stderr.strip().splitlines() == [f"error: {expected}"]


@pytest.mark.parametrize(
    ("sets", "start"),
    [
        (
            ["pipelining.schedule=interleaved_1f1b", "pipelining.stages_per_rank=4"],
            "cannot split 4 layers into 8 pipeline stages",
        ),
        (
            ["pipelining.schedule=dualpipev", "data.global_batch_size=4"],
            "pipeline schedule 'dualpipev' needs",
        ),
        (
            ["pipelining.schedule=interleaved_1f1b", "data.global_batch_size=10"],
            "pipeline schedule 'interleaved_1f1b' on 2 pipeline ranks needs a microbatch count divisible",
        ),
        (
            ["pipelining.schedule=1f1b", "providers.task=tiny_job.py:PlainTask"],
            "mesh.pipeline_parallel > 1 needs a task",
        ),
    ],
    ids=["more-stages-than-layers", "dualpipev-too-few-microbatches", "interleaved-indivisible", "task"],
)
def test_a_layout_the_trainer_refuses_is_refused_with_its_message(runner, pp_config, sets, start):
    overrides = ["mesh.pipeline_parallel=2", *sets]
    result = runner.invoke(cli, ["plan", str(pp_config), *[a for s in overrides for a in ("--set", s)]])
    assert result.exit_code == 2
    assert result.stdout == ""  # before any line of the plan
    expected = _trainer_layout_error(pp_config, *overrides)
    assert expected.startswith(start)
    assert result.stderr.strip().splitlines() == [f"error: {expected}"]


def test_a_model_provider_without_pipeline_num_layers_is_refused_like_the_trainer(runner, config):
    result = runner.invoke(cli, ["plan", str(config), *_mesh_sets(pipeline_parallel=2)])
    assert result.exit_code == 2 and result.stdout == ""
    expected = _trainer_layout_error(config, "mesh.pipeline_parallel=2")
    assert "needs a model provider with pipeline_num_layers()" in expected
    assert result.stderr.strip().splitlines() == [f"error: {expected}"]


# ------------------------------------------------------------------------------ declared abilities

#: Copies of the built-in data and optimizer providers under other names (not subclasses): what a
#: user's own providers with the same declarations look like to the plan.
COPIES = """
from d9d.trainer import AutoDataProviderFactory, BuiltinOptimizerProvider

def _copy(cls, name):
    return type(name, (), {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")})

MyData = _copy(AutoDataProviderFactory, "MyData")
MyOptimizer = _copy(BuiltinOptimizerProvider, "MyOptimizer")
"""


@pytest.mark.parametrize(
    "sets",
    [
        [
            "mesh.data_parallel_shard=2",
            "mesh.context_parallel=2",
            "optimizer.name=sgd",
            "optimizer.momentum=0.9",
        ],
        ["mesh.pipeline_parallel=2", "pipelining.schedule=interleaved_1f1b"],
    ],
    ids=["fsdp-cp-sgd", "pp"],
)
def test_a_copy_of_the_builtin_providers_gets_the_builtins_plan(runner, pp_config, cp_config, sets):
    config = pp_config if any("pipeline" in s for s in sets) else cp_config
    (config.parent / "copies.py").write_text(COPIES, encoding="utf-8")
    copies = ["providers.data=copies.py:MyData", "providers.optimizer=copies.py:MyOptimizer"]

    def plan_lines(overrides):
        result = runner.invoke(cli, ["plan", str(config), *[a for s in overrides for a in ("--set", s)]])
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        return lines[: lines.index(next(line for line in lines if line.startswith("launch (")))]

    builtin, copied = plan_lines(sets), plan_lines([*sets, *copies])
    assert copied == builtin
    assert any(line.startswith("data: global batch") for line in copied)  # declared, not assumed
    assert not any("assumed AdamW-like" in line for line in copied)
    from d9d.trainer.planning import plan_job

    jobs = [_resolved(config, *sets), _resolved(config, *sets, *copies)]
    with DistributedContext.for_planning(jobs[0].config.mesh) as ctx:
        plans = [plan_job(job, ctx) for job in jobs]
    assert plans[0] == plans[1]
    assert type(jobs[1].data_factory).__name__ == "MyData"


def test_an_optimizer_that_declares_nothing_is_assumed_adamw_like(runner, config):
    (config.parent / "own_optimizer.py").write_text(
        "import torch\n\n"
        "class OwnOptimizer:\n"
        "    def __init__(self, config):\n        self.config = config\n\n"
        "    def build_optimizer(self, named_parameters):\n"
        "        return torch.optim.SGD([p for _, p in named_parameters], lr=0.1)\n",
        encoding="utf-8",
    )
    result = runner.invoke(
        cli, ["plan", str(config), "--set", "providers.optimizer=own_optimizer.py:OwnOptimizer"]
    )
    assert result.exit_code == 0, result.output
    (line,) = _lines(result.output, "optimizer ")
    assert "assumed AdamW-like, 2 states per parameter" in line and "optimizer_states()" in line


def test_the_fine_tune_example_with_its_packed_rows_plans_on_cp_2(runner, tmp_path):
    config = Path(__file__).resolve().parents[3] / "examples" / "finetune" / "config.yaml"
    transformers = pytest.importorskip("transformers")
    model = tmp_path / "model"  # a tiny Qwen3 folder (no tokenizer: the plan reads no data)
    shape = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True}  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**shape)).save_pretrained(model)
    sets = ["--set", f"model.hf_folder={model}", *_mesh_sets(context_parallel=2)]
    result = runner.invoke(cli, ["plan", str(config), *sets])
    assert result.exit_code == 0, result.output  # packed rows split over cp ranks (no longer refused)
    assert "context_parallel=2" in result.output and "error" not in result.output
    (balance,) = _lines(result.output, "attention balance (packed rows)")
    assert "depends on the documents' lengths" in balance and "balance_documents: true evens it" in balance
    on = runner.invoke(cli, ["plan", str(config), *sets, "--set", "trainer.attention.balance_documents=true"])
    assert on.exit_code == 0, on.output
    (balance,) = _lines(on.output, "attention balance (packed rows)")
    assert "documents reordered within each row" in balance


QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart" / "config.yaml"


def test_plan_with_cpu_offload_counts_the_state_on_the_host_and_the_rest_on_the_device(runner):
    sets = ["--world-size", "2", "--seq-len", "32", "--set", "mesh.data_parallel_shard=2"]
    off = runner.invoke(cli, ["plan", str(QUICKSTART), *sets])
    on = runner.invoke(cli, ["plan", str(QUICKSTART), *sets, "--set", "trainer.memory.cpu_offload=true"])
    assert off.exit_code == 0 and on.exit_code == 0, (off.output, on.output)
    for name in ("parameters ", "gradients", "optimizer", "activations"):  # the same state, elsewhere
        assert _lines(on.output, name) == _lines(off.output, name)
    n = int(_lines(on.output, "model:")[0].split()[1].replace(",", ""))
    state = estimate_memory(n * 4, n * 4, pipeline_parallel=1, data_parallel_shard=2, context_parallel=1,
                            tensor_parallel=1, optimizer_states=2)  # fmt: skip
    acts = _lines(off.output, "activations")[0].split()[1:3]
    assert _lines(on.output, "host")[0].split()[1:3] == format_size(state.total).split()
    assert _lines(off.output, "total")[0].split()[1:3] != _lines(on.output, "total")[0].split()[1:3]
    assert _lines(on.output, "total")[0].split()[1:3] == acts  # nothing but activations stays on the device
    assert "offloaded to the host" in _lines(on.output, "total")[0]
    assert not _lines(off.output, "host")


def test_a_provider_that_ignores_cpu_offload_is_refused_like_the_trainer(runner, config):
    sets = ["--set", "mesh.data_parallel_shard=2", "--set", "trainer.memory.cpu_offload=true"]
    result = runner.invoke(cli, ["plan", str(config), "--world-size", "2", *sets])
    assert result.exit_code != 0 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "trainer.memory.cpu_offload is set but the model provider's parallelize_model_stage" in line
    assert "pass cpu_offload=context.cpu_offload to d9d.parallel.parallelize_hsdp" in line


def test_plan_names_the_all_gathered_keys_and_values_apart_under_cp(runner, cp_config):
    """One layer's K and V at the full 16 tokens (not the rank's 8): 2 × batch × 16 × hidden elements
    (heads × head_dim = hidden) in the compute dtype; without checkpointing every layer keeps its own."""
    result = runner.invoke(
        cli, ["plan", str(cp_config), "--world-size", "2", *_mesh_sets(context_parallel=2)]
    )
    assert result.exit_code == 0, result.output
    (acts,) = _lines(result.output, "activations")
    batch = int(acts.split("one microbatch of ")[1].split(" × ")[0])
    hidden, layers = 16, 2  # AttentionLMConfig's defaults
    itemsize = 2 if "in bfloat16" in acts else 4
    layer = 2 * batch * 16 * hidden * itemsize
    (kv,) = _lines(result.output, "of which K/V")
    assert kv.startswith(f"of which K/V {format_size(layers * layer):>7}"), kv
    assert f"{format_size(layer)} a layer" in kv
    plain = runner.invoke(
        cli, ["plan", str(cp_config), "--world-size", "2", *_mesh_sets(data_parallel_shard=2)]
    )
    assert _lines(plain.output, "of which K/V") == []  # nothing all-gathered without cp

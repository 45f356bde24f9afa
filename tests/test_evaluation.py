"""The validation loop (`eval:`) through the trainer with the quickstart: the eval numbers are the same
on 1 process, FSDP 2, DDP 2, cp 2 and pp 2 (forward only through the stages, on every layout: 1F1B,
interleaved, the V schedules; and composed with FSDP 2, TP 2 and CP 2), equal a hand computation from the final weights, land on the
step records at every period and at the end, and a resumed run never repeats one.

Ranks are forked from this process (`_quickstart.train`). SGD without clipping (fp32), as the other
parity tests. Measured largest relative spread of eval loss and perplexity against one process (4
steps, evals at 2 and 4): FSDP 2 9.5e-8 to 1.9e-7, DDP 2 9.5e-8 to 1.9e-7, cp 2 4.8e-8 to 2.9e-7
(mostly the training's own spread in the weights); pp 2 alone 0 on every schedule (the same ops in
the same order), pp 2 × FSDP 2 1.9e-7, × TP 2 2.9e-7, × CP 2 2.4e-7; the final eval against the hand
computation 1.6e-8. REL is 1e-6.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dispatch import OpRecorder
from _quickstart import CONFIG, NO_CLIP, ROOT, SGD, overrides, records, run_forked, train, train_and_gather

REL = 1e-6
STEPS = 4
#: The first 5 microbatches of 16 samples of the passages (969 samples of 32 tokens): on 2 dp ranks,
#: rank 0 runs 3 and rank 1 runs 2 plus a discarded third forward.
EVAL_SAMPLES = 5 * 16
EVAL = [
    "providers.eval_dataset=train.py:CorpusProvider",
    "eval_dataset.path=../data/passages.txt",
    "eval_dataset.seq_len=32",
    "eval.period_steps=2",
    "eval.microbatch_size=16",
    "eval.steps=5",
]
EVAL_KEYS = ("eval_loss", "eval_perplexity", "eval_tokens")


def _evals(run_dir) -> dict[int, dict[str, float]]:
    """{step: its eval numbers} of a run's metrics file (a step appearing twice fails)."""
    found: dict[int, dict[str, float]] = {}
    for record in records(run_dir):
        if "eval_loss" in record:
            assert record["step"] not in found, f"step {record['step']} has two eval records"
            found[record["step"]] = {key: record[key] for key in EVAL_KEYS}
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval-reference")
    result = train(1, overrides(tmp, "one", STEPS, *SGD, *NO_CLIP, *EVAL))
    return result, _evals(tmp / "one")


def test_period_and_end_of_run_evals_land_on_their_step_records(reference):
    result, evals = reference
    assert sorted(evals) == [2, 4]
    assert [r["step"] for r in result.records] == [1, 2, 3, 4]
    for numbers in evals.values():
        assert numbers["eval_tokens"] == EVAL_SAMPLES * 32
        assert numbers["eval_perplexity"] == pytest.approx(math.exp(numbers["eval_loss"]), rel=1e-12)
    assert evals[4]["eval_loss"] != evals[2]["eval_loss"]  # each eval saw the weights of its step


@pytest.mark.parametrize(
    ("name", "nproc", "mesh"),
    [
        ("fsdp2", 2, ["mesh.data_parallel_shard=2"]),
        ("ddp2", 2, ["mesh.data_parallel_replicate=2"]),
        ("cp2", 2, ["mesh.context_parallel=2"]),
        ("pp2-1f1b", 2, ["mesh.pipeline_parallel=2", "pipelining.schedule=1f1b"]),
        ("pp2-interleaved", 2, ["mesh.pipeline_parallel=2", "pipelining.schedule=interleaved_1f1b"]),
        ("pp2-zbv", 2, ["mesh.pipeline_parallel=2", "pipelining.schedule=zbv"]),
        ("pp2-dualpipev", 2, ["mesh.pipeline_parallel=2", "pipelining.schedule=dualpipev"]),
        ("pp2-fsdp2", 4, ["mesh.pipeline_parallel=2", "mesh.data_parallel_shard=2"]),
        ("pp2-tp2", 4, ["mesh.pipeline_parallel=2", "mesh.tensor_parallel=2"]),
        ("pp2-cp2", 4, ["mesh.pipeline_parallel=2", "mesh.context_parallel=2"]),
        (
            "pp2-zbv-fsdp2",
            4,
            ["mesh.pipeline_parallel=2", "mesh.data_parallel_shard=2", "pipelining.schedule=zbv"],
        ),
    ],
)
def test_eval_equals_one_process(tmp_path, reference, name, nproc, mesh):
    _, expected = reference
    train(nproc, overrides(tmp_path, name, STEPS, *SGD, *NO_CLIP, *EVAL, *mesh))
    got = _evals(tmp_path / name)
    assert sorted(got) == sorted(expected)
    spread = 0.0
    for step, numbers in expected.items():
        assert got[step]["eval_tokens"] == numbers["eval_tokens"]
        for key in ("eval_loss", "eval_perplexity"):
            spread = max(spread, abs(got[step][key] - numbers[key]) / abs(numbers[key]))
    print(f"{name}: eval spread against one process {spread:.1e}")
    assert spread <= REL, f"{name}: the eval differs from one process by {spread:.1e} (relative)"


def test_eval_equals_a_hand_computation_from_the_final_weights(reference):
    """The final weights in a plain model, the evaluated samples in one forward: the mean token loss."""
    result, evals = reference
    from d9d.data import TextDataset
    from d9d.trainer import load_job_config, resolve_job
    from d9d.trainer.models import ReferenceForCausalLM

    job = resolve_job(load_job_config(CONFIG, overrides(ROOT / "unused", "x", STEPS)))
    model = ReferenceForCausalLM(job.model_provider.config)
    model.init_weights()  # the non-persistent buffers (RoPE); every weight comes from the run
    model.load_state_dict(result.weights, strict=True)
    model.eval()
    dataset = TextDataset(ROOT / "examples" / "data" / "passages.txt", 32)
    samples = [dataset[i] for i in range(EVAL_SAMPLES)]
    input_ids = torch.stack([s["input_ids"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    with torch.no_grad():
        logits = model(input_ids).double()
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    mean = float(total) / labels.numel()
    assert evals[STEPS]["eval_tokens"] == labels.numel()
    spread = abs(evals[STEPS]["eval_loss"] - mean) / mean
    print(f"hand computation: eval spread {spread:.1e}")
    assert spread <= REL, f"the eval differs from the hand computation by {spread:.1e} (relative)"


def test_a_resumed_run_does_not_repeat_a_recorded_eval(tmp_path):
    """Crash at step 4 (save-2 committed with its eval), resume to 5, then extend to 6: one eval per
    due step (2, 4, the end 5, then 6) and one record per step."""
    args = overrides(tmp_path, "resumed", 5, *SGD, *NO_CLIP, *EVAL)
    with pytest.raises(AssertionError, match="injected failure"):
        run_forked(train_and_gather, args, env={"D9D_TEST_RAISE_AT_STEP": "4"})
    assert sorted(_evals(tmp_path / "resumed")) == [2]
    train(1, args)
    assert sorted(_evals(tmp_path / "resumed")) == [2, 4, 5]
    train(1, [*args, "trainer.schedule.total_steps=6"])
    evals = _evals(tmp_path / "resumed")
    assert sorted(evals) == [2, 4, 5, 6]
    assert [r["step"] for r in records(tmp_path / "resumed")] == [1, 2, 3, 4, 5, 6]
    assert all(numbers["eval_tokens"] == EVAL_SAMPLES * 32 for numbers in evals.values())


def _eval_host_syncs(save_root: str) -> tuple[int, int]:
    """Host syncs of one eval of 6 microbatches (and the microbatches it ran) on fresh weights."""
    from d9d.trainer import Trainer

    with (
        Trainer.from_config(CONFIG, overrides(Path(save_root), "syncs", 2, *EVAL, "eval.steps=6")) as trainer,
        OpRecorder() as recorder,
    ):
        result = trainer.evaluate()
    return recorder.host_syncs, int(result.tokens) // (16 * 32)


def test_an_eval_waits_for_the_device_once(tmp_path):
    assert run_forked(_eval_host_syncs, str(tmp_path)) == (1, 6)

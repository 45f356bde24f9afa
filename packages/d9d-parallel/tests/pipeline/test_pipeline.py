"""Every schedule on 2 pipeline ranks trains like one process: losses, grad norms, final parameters.

Real forked processes over gloo; the reference trains the whole model on the whole global batch in
one forward. SGD keeps reduction-order noise small enough for a 1e-5 tolerance.
"""

import pytest
import torch
from _pipeline_model import (
    SEQ,
    TinyConfig,
    assert_same_run,
    batches,
    build_stage,
    loss_fn,
    pipeline_run,
    reference_run,
)

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel.pipeline import Pipeline, PipelineConfig, PipelineError, plan_pipeline

PP2 = MeshConfig(pipeline_parallel=2)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(reference_run, 1)[0]


@pytest.mark.parametrize(
    ("schedule", "stages_per_rank", "n_microbatches"),
    [
        ("gpipe", 1, 4),
        ("1f1b", 1, 2),
        ("1f1b", 1, 4),
        ("interleaved_1f1b", 2, 4),
        ("interleaved_1f1b", 1, 2),
        ("interleaved_1f1b", 3, 4),  # 6 stages of 4 layers: embedding-only and head-only stages
        ("looped_bfs", 2, 4),
        ("looped_bfs", 1, 2),
        ("interleaved_zero_bubble", 2, 4),
        ("interleaved_zero_bubble", 1, 4),
        ("zbv", 2, 4),
        ("zbv", 2, 8),
        ("dualpipev", 2, 4),
    ],
)
def test_pp2_matches_one_process_2ranks(reference, schedule, stages_per_rank, n_microbatches):
    ranks = run_distributed(pipeline_run, 2, PP2, PipelineConfig(schedule, stages_per_rank), n_microbatches)
    assert_same_run(ranks, reference, rtol=1e-5, atol=1e-5)


def _misuse_and_plain_step() -> dict[str, object]:
    cfg = TinyConfig()
    with DistributedContext.from_env(PP2) as ctx:
        pp = ctx.mesh("dense")["pp"]
        errors = {}
        with pytest.raises(PipelineError, match="planned for 4 pipeline ranks") as info:
            Pipeline(plan_pipeline(4, 4), [], pp_group=pp, n_microbatches=4, loss_fn=loss_fn)
        errors["pp size"] = str(info.value)
        layout = plan_pipeline(cfg.n_layers, 2, PipelineConfig("1f1b"))
        modules = [build_stage(cfg, s) for s in layout.stages_of_rank(ctx.coordinate("pp"))]
        with pytest.raises(PipelineError, match="got 2 module"):
            Pipeline(layout, modules * 2, pp_group=pp, n_microbatches=4, loss_fn=loss_fn)
        with pytest.raises(PipelineError, match="at least as many microbatches"):
            Pipeline(layout, modules, pp_group=pp, n_microbatches=1, loss_fn=loss_fn)
        pipe = Pipeline(layout, modules, pp_group=pp, n_microbatches=2, loss_fn=loss_fn)
        tokens = batches(cfg)[0]
        micro = list(tokens.chunk(2))
        kwargs = [{"positions": torch.arange(SEQ)}] * 2
        with pytest.raises(PipelineError, match="expected 2 microbatch"):  # every rank refuses, none hangs
            pipe.step(micro[:1], micro[:1], kwargs=kwargs)
        with torch.no_grad(), pytest.raises(PipelineError, match="needs gradients enabled"):
            pipe.step(micro, micro, kwargs=kwargs)
        # a rank passes only what its stages read: the first stage's inputs, the last stage's targets
        inputs = [m[:, :-1] for m in micro] if pipe.has_first_stage else None
        targets = [m[:, 1:] for m in micro] if pipe.has_last_stage else None
        loss = pipe.step(inputs, targets, kwargs=kwargs)
        grads = {n: p.grad.clone() for m in modules for n, p in m.named_parameters()}
        return {"loss": loss, "last": pipe.has_last_stage, "grads": grads, "error": errors["pp size"]}


def test_step_contract_and_misuse_2ranks():
    first, last = run_distributed(_misuse_and_plain_step, 2)
    assert first["loss"] is None and not first["last"]
    assert last["last"]
    cfg = TinyConfig()
    model = build_stage(cfg, None)
    tokens = batches(cfg)[0]
    want = loss_fn(model(tokens[:, :-1], torch.arange(SEQ)), tokens[:, 1:])
    want.backward()
    torch.testing.assert_close(last["loss"], want.detach(), rtol=1e-6, atol=1e-6)
    # the summed microbatch gradients equal the whole batch's: never divided by the microbatch count
    grads = {**first["grads"], **last["grads"]}
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6)


def _shape_change_is_refused() -> str:
    cfg = TinyConfig()
    with DistributedContext.from_env(MeshConfig()) as ctx:  # a 1-rank "pipeline": one stage
        assert ctx.world_size == 1
        group = torch.distributed.group.WORLD
        layout = plan_pipeline(cfg.n_layers, 1, PipelineConfig("gpipe"))
        pipe = Pipeline(
            layout, [build_stage(cfg, layout.stages[0])], pp_group=group, n_microbatches=2, loss_fn=loss_fn
        )
        for seq in (SEQ, SEQ - 2):
            micro = list(batches(cfg)[0][:, : seq + 1].chunk(2))
            kwargs = [{"positions": torch.arange(seq)}] * 2
            try:
                pipe.step([m[:, :-1] for m in micro], [m[:, 1:] for m in micro], kwargs=kwargs)
            except PipelineError as exc:
                assert seq != SEQ
                return str(exc)
        raise AssertionError("a step with other input shapes ran")


def test_input_shapes_must_not_change_between_steps_1rank():
    message = run_distributed(_shape_change_is_refused, 1)[0]
    assert "same shapes every step" in message

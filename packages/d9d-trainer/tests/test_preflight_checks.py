"""The preflight's verdicts from what the ranks report: the CUDA checks (free memory against the
plan, ECC, clocks, matmul speed) name the ranks and nodes that fail them; a healthy fleet passes.
(The checks that need several processes run in tests/test_preflight.py.)"""

from d9d.trainer.planning.preflight import (
    PreflightReport,
    _cuda_checks,
    _RankFacts,
    format_preflight,
    slow_ranks,
)

GIB = 2**30


def _rank(rank: int, **extra: object) -> _RankFacts:
    values = {"device_free": 70 * GIB, "device_total": 80 * GIB, "ecc_uncorrected": 0, "sm_clock_mhz": 1980,
              "sm_clock_max_mhz": 1980, "matmul_flops": 700e12, **extra}  # fmt: skip
    return _RankFacts(rank=rank, host=f"node{rank // 2}", code="c", config="k", sees=(0, 1, 2, 3),
                      probe_error="", free_bytes=10**12, **values)  # type: ignore[arg-type]  # fmt: skip


def test_the_cuda_checks_name_each_failing_rank_and_its_node():
    facts = [_rank(0), _rank(1, device_free=20 * GIB), _rank(2, ecc_uncorrected=3),
             _rank(3, sm_clock_mhz=900, matmul_flops=300e12)]  # fmt: skip
    checks = {c.name: c for c in _cuda_checks(facts, need=40 * GIB, threshold=0.25)}
    assert not checks["device memory"].ok and checks["device memory"].detail.startswith(
        "rank 1 (node0) short"
    )
    assert "the plan needs 40.0 GiB" in checks["device memory"].detail
    assert not checks["ECC errors"].ok and checks["ECC errors"].detail.startswith(
        "rank 2 (node1): uncorrected ECC errors (3)"
    )
    assert not checks["clocks"].ok and checks["clocks"].detail.startswith(
        "rank 3 (node1) below the median: SM clock"
    )
    assert not checks["compute"].ok and checks["compute"].detail.startswith("rank 3 (node1) below the median")
    healthy = _cuda_checks([_rank(r) for r in range(4)], need=40 * GIB, threshold=0.25)
    assert [c.ok for c in healthy] == [True] * 4
    report = PreflightReport(world_size=4, nodes=("node0", "node0", "node1", "node1"), mesh="dp_shard=4",
                             device="cuda", checks=tuple(healthy))  # fmt: skip
    lines = format_preflight(report)
    assert (
        lines[0] == "preflight: 4 ranks on 2 nodes, mesh dp_shard=4, cuda"
        and lines[-1] == "all checks passed"
    )


def test_slow_ranks_compares_with_the_median():
    assert slow_ranks({0: 10.0, 1: 10.0, 2: 7.0, 3: 10.0}, 0.25) == [2]
    assert slow_ranks({0: 10.0, 1: 8.0}, 0.25) == []
    assert slow_ranks({0: 1.0}, 0.25) == []

"""Library notices to library authors are dropped; the same logger's other records get through."""

import logging
import subprocess
import sys

import pytest


def test_the_enum_notice_is_dropped_and_other_records_of_its_logger_are_kept(
    caplog: pytest.LogCaptureFixture,
):
    import d9d.mesh  # noqa: F401  (installs the filters)

    logger = logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING, logger="torch.utils._pytree"):
        logger.warning("%s is an Enum subclass and is now natively supported by torch.compile", "<enum X>")
        logger.warning("something else about %s", "pytrees")
    assert [r.getMessage() for r in caplog.records] == ["something else about pytrees"]


def test_importing_torchao_after_d9d_prints_nothing():
    pytest.importorskip("torchao")
    done = subprocess.run(
        [sys.executable, "-c", "import d9d.mesh, torchao.float8, torchao.prototype.quantization"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert done.stderr == ""

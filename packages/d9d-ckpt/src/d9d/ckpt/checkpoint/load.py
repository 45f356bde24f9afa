"""Loading a committed checkpoint: everything is checked on every rank before anything is read.

Rank 0 checks the files and reads the shared metadata once (`integrity.py`) and broadcasts what it
found; each rank reads only its own rank file and compares the checkpoint's keys, shapes and dtypes
with the state its model and optimizer expect. The ranks agree on what they found, so a checkpoint
that is damaged or does not fit is refused on every rank with the model untouched. With
`verify_on_load`, each rank checksums its share of the files on a thread while the load reads them
(`verifier_of`: every file has a verifier on any world size); a read that fails still waits for the
checksums and the ranks agree, so every rank names the damaged file, or else the read's failure.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from d9d.ckpt.checkpoint._failure import describe
from d9d.ckpt.checkpoint._group import CheckpointGroup
from d9d.ckpt.checkpoint.errors import CheckpointDamagedError, CheckpointError
from d9d.ckpt.checkpoint.extra import decode_state
from d9d.ckpt.checkpoint.integrity import (
    BackgroundVerification,
    CheckpointReport,
    check_keys,
    inspect_checkpoint,
    problem_report,
)
from d9d.ckpt.checkpoint.layout import EXTRA_FILE, CheckpointInfo, rank_file_name, recovery_hint
from d9d.ckpt.checkpoint.state_dicts import live_state, quiet_local_dcp, set_live_state
from d9d.ckpt.checkpoint.storage import KnownMetadataReader
from d9d.mesh import get_logger

__all__ = ["LoadedCheckpoint", "Loader"]

_log = get_logger("d9d.ckpt")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `CheckpointManager.load` read besides the model and optimizer state.

    Attributes:
        rank_state: this rank's `rank_state` from the save, or None when none was saved or the
            checkpoint was written by a different number of ranks (per-rank state such as RNG does
            not carry over to another layout).
    """

    info: CheckpointInfo
    extra_state: dict[str, Any]
    rank_state: dict[str, Any] | None

    @property
    def step(self) -> int:
        """The step the checkpoint was saved at."""
        return self.info.step


@dataclass
class _Findings:
    """What one rank found before anything is read into the model (filled by `Loader._examine`).

    Attributes:
        damage: damaged files: the checkpoint itself is broken.
        problems: the checkpoint does not fit the model.
        state: the live state dicts to load into.
        live: `state` flattened, by key.
        stored_keys: the checkpoint's keys in the sections being loaded.
    """

    damage: list[str]
    problems: list[str] = field(default_factory=list)
    rank_state: dict[str, Any] | None = None
    state: dict[str, Any] = field(default_factory=dict)
    live: dict[str, Any] = field(default_factory=dict)
    stored_keys: list[str] = field(default_factory=list)


class Loader:
    """Loads committed checkpoints into a model and optimizer, checked first (collective).

    Args:
        group: the checkpoint code's own process group.
        verify_on_load: compare each rank's share of the files with the recorded checksums while
            the load reads them (see `CheckpointManager`).
    """

    def __init__(self, group: CheckpointGroup, *, verify_on_load: bool) -> None:
        self._group = group
        self._verify_on_load = verify_on_load

    def read_extra_state(self, info: CheckpointInfo) -> dict[str, Any]:
        """`CheckpointManager.read_extra_state`: rank 0 reads it, every rank gets it; `{}` if unreadable."""

        def read() -> dict[str, Any]:
            try:
                return decode_state((info.path / EXTRA_FILE).read_bytes(), f"{info.path.name}/{EXTRA_FILE}")
            except (CheckpointError, OSError):
                return {}

        state: dict[str, Any] = self._group.broadcast(read() if self._group.rank == 0 else None)
        return state

    def load(
        self, info: CheckpointInfo, model: nn.Module | None, optimizer: torch.optim.Optimizer | None
    ) -> LoadedCheckpoint:
        """`CheckpointManager.load` of the checkpoint `info`: check, agree, read, verify."""
        if optimizer is not None and not info.meta.has_optimizer:
            raise CheckpointError(
                f"checkpoint {info.path} holds no optimizer state (it was saved without one); "
                "load it with optimizer=None"
            )
        report: CheckpointReport = self._group.broadcast(
            inspect_checkpoint(info, with_metadata=model is not None) if self._group.rank == 0 else None
        )
        verification = self._start_verification(info, report)
        found = self._examine(info, report, model, optimizer)
        self._agree_to_read(info, found, verification, model)
        failure = None
        if model is not None and report.metadata is not None:
            failure = self._read_into(info, report.metadata, found.state, model, optimizer)
        damaged, failures = self._after_read(verification, failure)
        if damaged or failures:
            hint = self._group.broadcast(recovery_hint(info.path) if self._group.rank == 0 else None)
            if damaged:  # a damaged file explains a failed read: name the file
                raise CheckpointDamagedError(
                    problem_report(info.path, damaged, hint, loaded=model is not None)
                )
            raise CheckpointDamagedError(
                f"reading checkpoint {info.path} failed after it passed its checks ({failures[0]}); "
                f"the model state is undefined: load again, or {hint}"
            )
        _log.info("checkpoint loaded", step=info.step, path=str(info.path))
        return LoadedCheckpoint(info=info, extra_state=report.extra_state, rank_state=found.rank_state)

    # ------------------------------------------------------------------ checks before the read

    def _start_verification(
        self, info: CheckpointInfo, report: CheckpointReport
    ) -> BackgroundVerification | None:
        """Start checksumming this rank's share of the files, unless there is nothing to verify."""
        if self._verify_on_load and info.meta.checksums is None and self._group.rank == 0:
            _log.warning(
                "checkpoint has no checksums (saved before d9d recorded them): its files are not verified",
                step=info.step,
                path=str(info.path),
            )
        elif self._verify_on_load and not report.problems:
            # each rank checksums its share of the files while the load below reads them
            return BackgroundVerification(info, self._group.rank, self._group.world_size)
        return None

    def _examine(
        self,
        info: CheckpointInfo,
        report: CheckpointReport,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
    ) -> _Findings:
        """This rank's checks: its own rank file, and whether the checkpoint fits the model."""
        found = _Findings(damage=list(report.problems))
        if not found.damage:
            own_name = rank_file_name(self._group.rank)
            if info.meta.world_size == self._group.world_size and own_name in info.meta.files:
                try:
                    found.rank_state = decode_state(
                        (info.path / own_name).read_bytes(), f"{info.path.name}/{own_name}"
                    )
                except (CheckpointError, OSError) as exc:
                    found.damage.append(str(exc))
        if model is not None and not found.damage:
            if report.metadata is None:
                found.damage.append(str(report.metadata_error))
            else:
                _check_fit(info, report.metadata, model, optimizer, found)
        return found

    def _agree_to_read(
        self,
        info: CheckpointInfo,
        found: _Findings,
        verification: BackgroundVerification | None,
        model: nn.Module | None,
    ) -> None:
        """Raise on every rank when any rank found damage or a mismatch (collective)."""
        gathered = self._group.all_gather((found.damage, found.problems))
        damaged = list(dict.fromkeys(p for rank_damage, _ in gathered for p in rank_damage))
        refused = bool(damaged) or any(rank_problems for _, rank_problems in gathered)
        if refused and verification is not None:  # refused before the load: its checksums add nothing
            verification.result()
        if damaged:
            hint = self._group.broadcast(recovery_hint(info.path) if self._group.rank == 0 else None)
            raise CheckpointDamagedError(problem_report(info.path, damaged, hint))
        merged = list(dict.fromkeys(p for _, rank_problems in gathered for p in rank_problems))
        if not merged and model is not None:
            merged = self._unexpected_keys(found)
        if merged:
            raise CheckpointError(problem_report(info.path, merged, damaged=False))

    def _unexpected_keys(self, found: _Findings) -> list[str]:
        """Keys of the loaded sections that the checkpoint holds but no rank asked for (collective)."""
        wanted = self._group.any_true(
            torch.tensor([k in found.live for k in found.stored_keys], dtype=torch.bool)
        )
        return [
            f"unexpected key {k}: the checkpoint holds it, the model does not expect it"
            for k, hit in zip(found.stored_keys, wanted.tolist(), strict=True)
            if not hit
        ]

    # ------------------------------------------------------------------ the read

    def _read_into(
        self,
        info: CheckpointInfo,
        metadata: Metadata,
        state: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
    ) -> str | None:
        """Read the checked checkpoint into the model and optimizer (collective): None, or one line on
        why the read failed (DCP fails it on every rank; its `CheckpointException` is no `Exception`)."""
        try:
            with quiet_local_dcp():
                dcp.load(
                    state,
                    storage_reader=KnownMetadataReader(info.path, metadata),
                    process_group=self._group.group,
                    no_dist=self._group.is_local,
                )
            set_live_state(model, optimizer, state, info.meta.format, trainable_only=info.meta.trainable_only)
        except (Exception, CheckpointException) as exc:
            return describe(exc)
        return None

    def _after_read(
        self, verification: BackgroundVerification | None, failure: str | None
    ) -> tuple[list[str], list[str]]:
        """Every rank's checksum problems and read failures, once each rank's verification thread
        ended (collective: a rank whose read failed still joins, so every rank raises the same)."""
        mine = verification.result() if verification is not None else []
        gathered = self._group.all_gather((mine, failure))
        damaged = list(dict.fromkeys(p for problems, _ in gathered for p in problems))
        return damaged, list(dict.fromkeys(f for _, f in gathered if f is not None))


def _check_fit(
    info: CheckpointInfo,
    metadata: Metadata,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    found: _Findings,
) -> None:
    """Build the live state to load into and compare its keys, shapes and dtypes with the checkpoint's."""
    try:
        found.state = live_state(model, optimizer, info.meta.format, trainable_only=info.meta.trainable_only)
    except Exception as exc:
        found.problems.append(f"the model's state dict cannot be built: {describe(exc)}")
        return
    found.live, _ = flatten_state_dict(found.state)
    found.problems += check_keys(found.live, metadata)
    found.stored_keys = sorted(k for k in metadata.state_dict_metadata if k.split(".", 1)[0] in found.state)

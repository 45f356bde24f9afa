"""Fault injection for d9d's own fault tests (tests/faults). TEST-ONLY: never set these in a real job.

D9D_TEST_HANG_AT_STEP=N   [D9D_TEST_HANG_RANK=R (default 0)] [D9D_TEST_HANG_S (default 3600)]
    rank R sleeps at the start of step N (a hung rank).
Every D9D_TEST_*_RANK may be `any`: each rank that has the variable (e.g. one node's, whatever ranks
the rendezvous gave it).
D9D_TEST_RAISE_AT_STEP=N  [D9D_TEST_RAISE_RANK=R (default 0)] [D9D_TEST_RAISE_ONCE=PATH]
    rank R raises RuntimeError at the start of step N; with RAISE_ONCE, only while PATH does not
    exist (it is created first), so a restarted job gets past the step.
D9D_TEST_SIGNAL_AT_STEP=N [D9D_TEST_SIGNAL_RANK=R (default 0)] [D9D_TEST_SIGNAL=TERM|INT (default TERM)]
    rank R sends itself the signal at the start of step N (a pre-emption in the middle of a step).
D9D_TEST_SLOW_COLLECTIVES_S=S [D9D_TEST_SLOW_RANK=R (default 0)]
    rank R sleeps S seconds before each collective that `d9d preflight` times (a slow rank).
D9D_TEST_SLOW_STEP_S=S [D9D_TEST_SLOW_RANK=R (default 0)] [D9D_TEST_SLOW_FROM_STEP=N (default 1)]
    rank R sleeps S seconds at the start of every step from step N on (a straggler).
"""

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FaultInjection"]


@dataclass(frozen=True)
class FaultInjection:
    """The faults the environment asks this rank to inject (none in a real job)."""

    rank: int
    hang_step: int | None = None
    hang_s: float = 3600.0
    raise_step: int | None = None
    raise_once: Path | None = None
    signal_step: int | None = None
    signal_name: str = "TERM"
    slow_collectives: float = 0.0
    slow_step_s: float = 0.0
    slow_from_step: int = 1

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] | None = None) -> "FaultInjection":
        """Read the D9D_TEST_* variables for `rank`."""
        env = os.environ if environ is None else environ

        def step_for(prefix: str) -> int | None:
            at = env.get(f"D9D_TEST_{prefix}_AT_STEP")
            which = env.get(f"D9D_TEST_{prefix}_RANK", "0")
            return int(at) if at and (which == "any" or int(which) == rank) else None

        once = env.get("D9D_TEST_RAISE_ONCE")
        slow_rank = env.get("D9D_TEST_SLOW_RANK", "0")
        slowed = slow_rank == "any" or int(slow_rank) == rank
        return cls(
            rank=rank,
            hang_step=step_for("HANG"),
            hang_s=float(env.get("D9D_TEST_HANG_S", "3600")),
            raise_step=step_for("RAISE"),
            raise_once=Path(once) if once else None,
            signal_step=step_for("SIGNAL"),
            signal_name=env.get("D9D_TEST_SIGNAL", "TERM"),
            slow_collectives=float(env.get("D9D_TEST_SLOW_COLLECTIVES_S") or 0) if slowed else 0.0,
            slow_step_s=float(env.get("D9D_TEST_SLOW_STEP_S") or 0) if slowed else 0.0,
            slow_from_step=int(env.get("D9D_TEST_SLOW_FROM_STEP", "1")),
        )

    def before_step(self, step: int) -> None:
        """Inject this rank's fault for `step`, if any."""
        if self.slow_step_s and step >= self.slow_from_step:
            time.sleep(self.slow_step_s)
        if step == self.signal_step:
            os.kill(os.getpid(), getattr(signal, f"SIG{self.signal_name}"))
        if step == self.hang_step:
            time.sleep(self.hang_s)
        if step == self.raise_step:
            if self.raise_once is not None:
                if self.raise_once.exists():
                    return
                self.raise_once.touch()
            raise RuntimeError(
                f"injected failure on rank {self.rank} at step {step} (D9D_TEST_RAISE_AT_STEP)"
            )

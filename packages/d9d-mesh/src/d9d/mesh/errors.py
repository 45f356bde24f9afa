"""Exception types of d9d.mesh: every message says what was wrong and how to fix it."""

__all__ = [
    "D9dError",
    "LaunchError",
    "MeshConfigError",
    "RendezvousError",
]


class D9dError(Exception):
    """Base class of every error d9d raises on purpose (bad input, bad launch, bad state)."""


class MeshConfigError(D9dError, ValueError):
    """A `mesh:` section breaks a rule (a degree below 1, expert_parallel that does not divide, ...)."""


class LaunchError(D9dError, RuntimeError):
    """The processes that were launched do not match the mesh, or the launch environment is broken."""


class RendezvousError(LaunchError):
    """This rank could not reach the launch's rendezvous store (so it cannot tell whether others failed too)."""

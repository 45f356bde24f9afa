"""Whether a provider declares an optional ability: its methods, not attributes that share their names."""


def undeclared_methods(instance: object, ability: type) -> list[str]:
    """The methods of `ability` (a protocol of `d9d.trainer.providers`) that `instance` has as attributes but not as methods.

    `isinstance(instance, ability)` only sees that the names exist; an attribute that happens to
    share a name (`self.batching = {...}`) is no declaration, and the trainer refuses it rather than
    call it (`d9d.trainer.job.resolve.resolve_job`).
    """
    if not isinstance(instance, ability):
        return []
    names = [name for name, value in vars(ability).items() if not name.startswith("_") and callable(value)]
    return [name for name in names if not callable(getattr(instance, name))]

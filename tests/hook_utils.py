"""Trainer classes with one of the NaN guard's upstream hooks taken out, for the hook check's tests
(`tests/guard/test_upstream_hooks.py`) and the distributed worker (`tests/workers/guard_worker.py --bypass`)."""

from __future__ import annotations


def upstream_method(trainer_cls: type, name: str):
    """The implementation of `name` that safe_trainers' override would call: the first one in the MRO of
    `trainer_cls` defined neither in safe_trainers nor in a subclass of its classes (TRL's, or transformers')."""
    from safe_trainers.trainer.generation import OnlineGenerationMixin
    from safe_trainers.trainer.hooks import NanGuardTrainerMixin

    for klass in trainer_cls.__mro__:
        ours = klass.__module__.startswith("safe_trainers") or issubclass(klass, NanGuardTrainerMixin)
        if name in vars(klass) and not ours and not issubclass(klass, OnlineGenerationMixin):
            return vars(klass)[name]
    raise AttributeError(f"no upstream `{name}` in the MRO of {trainer_cls.__name__}")


def bypassing(trainer_cls: type, *hooks: str) -> type:
    """A subclass of `trainer_cls` whose `hooks` go straight to the upstream implementation, so safe_trainers'
    overrides never run: what a subclass that overrides a hook without `super()` does, and what an upstream release
    that renames the hook, or stops calling it, does to the guard."""
    if not hooks:
        return trainer_cls
    namespace = {name: upstream_method(trainer_cls, name) for name in hooks}
    namespace["__doc__"] = f"{trainer_cls.__name__} without safe_trainers' {', '.join(hooks)}."
    return type(f"{trainer_cls.__name__}Bypassing", (trainer_cls,), namespace)

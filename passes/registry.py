"""The registry: every fusion pass by name, in the order the manager runs them.

Tools enumerate passes from here, so a new pass joins `megafuse run/ablate/inspect` by registering.
"""

from __future__ import annotations

from .base import FusionPass

_PASSES: dict[str, type[FusionPass]] = {}


def register(cls: type[FusionPass]) -> type[FusionPass]:
    if cls.name in _PASSES:
        raise ValueError(f"pass {cls.name!r} is registered twice")
    _PASSES[cls.name] = cls
    return cls


def available() -> list[str]:
    """Registered pass names in the order the manager runs them (each pass's `run_order`)."""
    _load_builtin_passes()
    return sorted(_PASSES, key=lambda name: _PASSES[name].run_order)


def descriptions() -> dict[str, str]:
    return {name: _PASSES[name].description for name in available()}


def get(name: str) -> type[FusionPass]:
    _load_builtin_passes()
    if name not in _PASSES:
        raise ValueError(f"unknown pass {name!r}; valid passes: {', '.join(available()) or '(none)'}")
    return _PASSES[name]


def resolve(selection) -> list[str]:
    """'all' | 'none' | a list (or comma-separated string) of names -> names in registry order. An
    empty string is an error (say 'none'); an empty list, as a program builds it, selects none."""
    names = available()
    if selection in ("all", None):
        return names
    if selection == "none":
        return []
    chosen = selection.split(",") if isinstance(selection, str) else list(selection)
    chosen = [c.strip() for c in chosen if c.strip()]
    if not chosen and isinstance(selection, str):  # "" or " , ": a slip, not a request for the baseline ("none")
        raise ValueError(f"no pass selected ({selection!r}); valid: 'all', 'none' (plain Inductor) or names "
                         f"among {', '.join(names)}")
    for c in chosen:
        get(c)  # raises with the valid choices
    return [n for n in names if n in chosen]


def _load_builtin_passes() -> None:
    # Importing a pass module registers it; kept lazy so `passes.registry` imports nothing heavy.
    from . import mega_mhc  # noqa: F401
    from . import mega_gate  # noqa: F401
    from . import mega_attention  # noqa: F401
    from . import mega_moe  # noqa: F401
    from . import mega_indexer  # noqa: F401

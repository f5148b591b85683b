"""passes/torch_fixes.py: the rounding fix declines exactly the narrowing round trips, only inside a
megafuse compile, and finds the pattern it fixes in the installed torch."""

from types import SimpleNamespace

import torch

from megafuse.passes import torch_fixes


def _match(dtype1, dtype2):
    return SimpleNamespace(kwargs={"arg": None, "dtype1": dtype1, "dtype2": dtype2})


def test_the_fix_keeps_narrowing_round_trips_inside_megafuse_compiles_only():
    entry = SimpleNamespace(extra_check=lambda match: True)
    torch_fixes._keep_roundings_in(entry)
    round_trip, same_width, narrow_last = (_match(torch.bfloat16, torch.float32), _match(torch.bfloat16, torch.float16),
                                           _match(torch.float32, torch.bfloat16))
    assert entry.extra_check(round_trip)  # outside a megafuse compile: torch's own decision
    with torch_fixes.eager_roundings():
        assert not entry.extra_check(round_trip)  # x rounded to bf16 and widened keeps its rounding
        assert not entry.extra_check(_match(torch.float16, torch.float32))
        assert not entry.extra_check(_match(torch.float32, torch.float64))
        # an intermediate no narrower than the result: the shortcut loses nothing torch keeps
        assert entry.extra_check(same_width) and entry.extra_check(narrow_last)
        with torch_fixes.eager_roundings():
            pass
        assert not entry.extra_check(round_trip)  # nested use restores, not clears
    assert entry.extra_check(round_trip)


def test_the_pattern_it_fixes_exists_in_this_torch():
    # found by its handler: if Inductor renames it, this fails here rather than the fix lapsing
    assert len(torch_fixes._pointless_convert_entries()) >= 1

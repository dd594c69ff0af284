"""Command-line numbers, parsed and range-checked by argparse before any host is contacted.

    p.add_argument("--warmups", type=count(0, 10_000))
    p.add_argument("--rate", type=numbers(0, 1e6, lo_open=True))   # "1,2.5,8"

A value that is not a number, not finite (``nan``, ``inf``, ``1e400``), out of range, or a
comma list with an empty item is an argparse error: exit 2 with the usage line and what to give.
The ranges follow the spec schema where the spec has the same setting (e.g. ``rollout
--drain-timeout``: ``rollout.drain_timeout``, 0 to 86400 s).
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Callable

_INT = re.compile(r"[+-]?[0-9]+")


def _n(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _range(lo: float | None, hi: float | None, lo_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"{'above' if lo_open else 'from'} {_n(lo)} {'and at most' if lo_open else 'to'} {_n(hi)}"
    if lo is not None:
        return f"{'above' if lo_open else 'at least'} {_n(lo)}"
    return f"at most {_n(hi)}"


def _check(x: float, text: str, lo: float | None, hi: float | None, lo_open: bool, what: str) -> None:
    if (lo is not None and (x < lo or (lo_open and x == lo))) or (hi is not None and x > hi):
        raise argparse.ArgumentTypeError(f"{text!r}: give {what} {_range(lo, hi, lo_open)}")


def count(lo: int | None = 1, hi: int | None = None) -> Callable[[str], int]:
    """A whole number in [lo, hi] (``1e3``, ``2.0`` and ``0x10`` are not)."""

    def parse(text: str) -> int:
        t = text.strip()
        if not _INT.fullmatch(t):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give one {_range(lo, hi, False)}")
        x = int(t)
        _check(x, text, lo, hi, False, "a whole number")
        return x

    parse.__name__ = "whole number"  # argparse's "invalid <name> value" for other errors
    return parse


def number(lo: float | None = 0, hi: float | None = None, *, lo_open: bool = True) -> Callable[[str], float]:
    """A finite number in (lo, hi] (``lo_open``) or [lo, hi]."""

    def parse(text: str) -> float:
        try:
            x = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: give one {_range(lo, hi, lo_open)}") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number: give one {_range(lo, hi, lo_open)}")
        _check(x, text, lo, hi, lo_open, "a number")
        return x

    parse.__name__ = "number"
    return parse


def _listed(item: Callable[[str], float], what: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        parts = text.split(",")
        if any(not p.strip() for p in parts):
            raise argparse.ArgumentTypeError(f"{text!r}: an empty item; give comma-separated {what}, e.g. 1,4,16")
        out = [item(p) for p in parts]
        if len(set(out)) != len(out):
            raise argparse.ArgumentTypeError(f"{text!r}: a value given twice; give each {what[:-1]} once")
        return out

    parse.__name__ = what
    return parse


def counts(lo: int | None = 1, hi: int | None = None) -> Callable[[str], list[int]]:
    """``1,4,16``: whole numbers in [lo, hi], none twice."""
    return _listed(count(lo, hi), "whole numbers")


def numbers(lo: float | None = 0, hi: float | None = None, *, lo_open: bool = True) -> Callable[[str], list[float]]:
    """``0.5,2,8``: finite numbers in (lo, hi], none twice."""
    return _listed(number(lo, hi, lo_open=lo_open), "numbers")


#: The INVENTORY argument of every command that reaches hosts: what ``pyinfra`` itself takes,
#: read by the one reader (vllm_fleet.specs.inventory.load_inventory).
INVENTORY_HELP = (
    "pyinfra inventory: a .py file, or the hosts inline as pyinfra takes them: @local (this machine), "
    "user@host, @ssh/host, host1,host2 (inline hosts are the `servers` group; host data with --data)"
)


def add_inventory_arguments(p: argparse.ArgumentParser, help: str = INVENTORY_HELP) -> None:
    """INVENTORY and ``--data KEY=VALUE`` (pyinfra's override data: highest precedence; how an
    inline inventory gets its login, e.g. ``--data ssh_key=~/.ssh/id_ed25519 --data _sudo=true``)."""
    p.add_argument("inventory", metavar="INVENTORY", help=help)
    p.add_argument(
        "--data", action="append", metavar="KEY=VALUE", help="pyinfra override data for every host (repeatable)"
    )

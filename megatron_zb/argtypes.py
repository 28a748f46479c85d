"""Small argparse types shared by every command line of megatron-zb (``cli``, ``verify``, the
training flags). Each one turns bad text into one ``argparse.ArgumentTypeError`` line naming the
flag and what it accepts. No torch, no megatron."""
from __future__ import annotations

import argparse

__all__ = ["number_list", "nonneg", "int_at_least", "positive_int", "positive_float", "share_or_auto"]


def number_list(name):
    """A non-negative number or a comma list of them (one per stage), as a list of floats."""
    def parse(text: str):
        vals = []
        for part in str(text).split(","):
            try:
                x = float(part)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{name} must be a number or a comma list of numbers, "
                                                 f"got {text!r}") from None
            if not (x >= 0 and x != float("inf")):
                raise argparse.ArgumentTypeError(f"{name} must be non-negative, got {text!r}")
            vals.append(x)
        return vals
    return parse


def nonneg(name):
    """One non-negative finite number."""
    def parse(text):
        vals = number_list(name)(text)
        if len(vals) != 1:
            raise argparse.ArgumentTypeError(f"{name} takes one number, got {text!r}")
        return vals[0]
    return parse


def int_at_least(name, lo):
    """An integer >= lo."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {lo}, got {v}")
        return v
    return parse


def positive_int(name):
    return int_at_least(name, 1)


def positive_float(name):
    """A finite number > 0."""
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive number, got {text!r}") from None
        if not (v > 0 and v != float("inf")):
            raise argparse.ArgumentTypeError(f"{name} must be a positive number, got {text!r}")
        return v
    return parse


def share_or_auto(name):
    """A number in 0..1 or the word 'auto' (e.g. an offload ratio)."""
    def parse(text):
        t = str(text).strip().lower()
        if t == "auto":
            return "auto"
        try:
            v = float(t)
        except ValueError:
            v = -1.0
        if not (0.0 <= v <= 1.0):
            raise argparse.ArgumentTypeError(f"{name} takes a number in 0..1 or 'auto', got {text!r}")
        return v
    return parse

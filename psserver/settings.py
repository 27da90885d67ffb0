"""One schema for settings: every key once, with its type, bounds or choices, default and meaning.

A settings dataclass (``ServerConfig``, ``TrainConfig``, ``JobConfig``) declares each field with
:func:`setting`, which keeps a :class:`Setting` in the field's metadata; the type is the field's
annotation. Everything that used to restate a key reads it from there instead: the class's checks
(:func:`check_fields`), the command-line flags (:func:`flag_specs`) and the README's tables
(scripts/gen_settings_tables.py, checked by tests/test_settings.py). Rules that join two keys
(``tls_cert`` needs ``tls_key``) stay in the class's ``validate``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (test, the words after "must be"), as psserver/kernels/optim.py's BOUNDS state the optimizer's.
Bound = tuple[Callable[[Any], bool], str]


@dataclass(frozen=True)
class Setting:
    """What the schema knows of one key besides its name, type and default.

    Parameters
    ----------
    doc : str
        One line of meaning, as the README's table and ``--help`` show it.
    bound : Bound, optional
        A value must pass ``bound[0]``; the refusal says ``NAME must be {bound[1]}, got VALUE``.
    choices : tuple, optional
        The values allowed; the refusal says ``NAME must be one of (...), got VALUE``.
    flag : str, optional
        Its command-line flag where not ``--NAME`` (``--device`` for ``shard_device``).
    shown : str, optional
        How the README shows a default that is decided at run time ("made per job").
    cli : str
        What only a command line needs to hear, added to ``doc`` in ``--help``.
    """

    doc: str
    bound: Bound | None = None
    choices: tuple | None = None
    flag: str | None = None
    shown: str | None = None
    cli: str = ""


def setting(
    default: Any,
    doc: str,
    *,
    bound: Bound | None = None,
    choices: tuple | None = None,
    flag: str | None = None,
    shown: str | None = None,
    cli: str = "",
) -> Any:
    """A dataclass field with its :class:`Setting`; a list default is copied for every instance."""
    meta = {"setting": Setting(doc, bound, tuple(choices) if choices is not None else None, flag, shown, cli)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# Bounds of the common shapes, worded as the messages always were.
def at_least(low) -> Bound:
    return (lambda v: v >= low), f">= {low}"


def above(low) -> Bound:
    return (lambda v: v > low), f"> {low}"


def between(low: int, high: int) -> Bound:
    """An integer in ``low..high``, both included."""
    return (lambda v: low <= v <= high), f"in {low}..{high}"


@dataclass(frozen=True)
class Key:
    """One key of a settings class: its name, type (the annotation), default and :class:`Setting`."""

    name: str
    type: Any
    default: Any
    setting: Setting

    @property
    def flag(self) -> str:
        return self.setting.flag if self.setting.flag is not None else "--" + self.name.replace("_", "-")


@functools.cache
def keys(cls) -> tuple[Key, ...]:
    """The keys of settings class ``cls``, in declaration order (fields without a Setting left out)."""
    found = []
    for f in dataclasses.fields(cls):
        if "setting" in f.metadata:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            found.append(Key(f.name, _annotation(cls, f), default, f.metadata["setting"]))
    return tuple(found)


def _annotation(cls, f: dataclasses.Field) -> Any:
    """A field's type, its annotation evaluated in its module (one field at a time, so that another field's
    type imported for type checkers only, such as JobConfig's ``train``, is never needed)."""
    if not isinstance(f.type, str):
        return f.type
    return eval(f.type, vars(sys.modules[cls.__module__]))  # noqa: S307 (the class's own source text)


def problem(name: str, value: Any, s: Setting) -> str | None:
    """Why ``value`` is refused for key ``name`` (one line), or None when its choices and bound allow it."""
    if s.choices is not None and value not in s.choices:
        return f"{name} must be one of {s.choices}, got {value!r}"
    if s.bound is not None and value is not None:
        test, words = s.bound
        try:
            ok = bool(test(value))
        except TypeError:  # a value of another type than the key's: refused, not a traceback
            ok = False
        if not ok:
            return f"{name} must be {words}, got {value!r}"
    return None


def check_fields(config, error: type[Exception], leave: tuple[str, ...] = ()) -> None:
    """Raise ``error`` naming the first key of ``config`` its schema refuses (keys in ``leave`` skipped)."""
    for key in keys(type(config)):
        if key.name not in leave:
            reason = problem(key.name, getattr(config, key.name), key.setting)
            if reason:
                raise error(reason)


def plain_type(hint: Any) -> Any:
    """``int | None`` -> ``int``: the type a given value has (None means "not set" for any key)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def toml_text(value: Any) -> str:
    """``value`` as a job file spells it: ``true``, ``"async"``, ``[128]``, ``0.01``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_text(v) for v in value) + "]"
    return repr(value)


def shown_default(key: Key) -> str:
    """The default as the README and ``--help`` show it: its Setting's words, ``none``, or its TOML."""
    if key.setting.shown is not None:
        return key.setting.shown
    return "none" if key.default is None else f"`{toml_text(key.default)}`"


def meaning(key: Key) -> str:
    """The key's doc and, where it has one, its bound: what the README's table says of it."""
    return f"{key.setting.doc} ({key.setting.bound[1]})" if key.setting.bound else key.setting.doc


def split_list(text: str) -> list[str]:
    """A comma-separated flag value as a list: ``"3:3,1:exp:20"`` -> ``["3:3", "1:exp:20"]``."""
    return [item.strip() for item in text.split(",") if item.strip()]


def flag_specs(cls, only: tuple[str, ...] | None = None, *, defaults: bool = True) -> list[tuple[str, str, Any, str]]:
    """``(flag, key, type or choices, help)`` of every key of ``cls`` with a flag, or of the keys in ``only``.

    The type is ``bool`` for an on/off flag (``--x``/``--no-x``), a tuple of choices, or a converter
    (``int``, ``float``, ``str``, :func:`split_list` for a list of strings); a key of another type (a
    list of numbers) is left to ``--set``. The help is the key's meaning, its
    command-line note and, unless ``defaults`` is False (flags over a job file's values), its default.
    """
    specs = []
    for key in keys(cls):
        if only is not None and key.name not in only:
            continue
        kind = key.setting.choices or _converter(plain_type(key.type))
        if kind is None:
            continue
        note = f" {key.setting.cli}" if key.setting.cli else ""
        default = f" (default: {shown_default(key)})" if defaults else ""
        text = f"{meaning(key)}{note}{default}".replace("`", "")  # markdown's quotes read as noise in --help
        specs.append((key.flag, key.name, kind, text))
    return specs


def _converter(hint: Any) -> Any:
    if hint in (bool, int, float, str):
        return hint
    if typing.get_origin(hint) is list and typing.get_args(hint) == (str,):
        return split_list
    return None

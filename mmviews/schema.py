"""The one validator of recipe sections: a mapping checked against a dataclass's annotations.

Every section of a recipe that has a schema is read through :func:`build_section`: the
training sections of :mod:`mmviews.config`, each adapter's config
(:class:`mmviews.modalities.AdapterConfig`) and the evaluation tasks' parameters. So every
section gives the same errors: a :class:`ConfigError` naming the source, the key path and the
value, with a did-you-mean hint for a misspelt key. It sits below every layer that has a
section, and imports no torch.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import re
import types
import typing
from typing import Any, Literal, Mapping, Sequence

from mmviews.registry import did_you_mean


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the file and the key."""


# Numbers in exponent notation without a dot ("3e-4"), which YAML 1.1 leaves as strings.
FLOAT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")

# The words YAML 1.1 (PyYAML) reads as False and True, lower case as users write them.
_YAML_BOOL_SPELLINGS: dict[bool, tuple[str, ...]] = {False: ("no", "off", "false"), True: ("yes", "on", "true")}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def where(source: str, key: str) -> str:
    """The start of an error message about ``key`` of ``source``: ``"SOURCE: key 'KEY'"`` (the
    form :func:`mmviews.config.override_of_error` reads back to name the ``--set`` at fault)."""
    return f"{source}: key '{key}'"


def coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; returns the value (ints widened to
    float where a float is expected, nested mappings turned into dataclasses). ``key``: the
    value's dotted key path, ``source``: the file (or other origin) it came from; both are named
    in the :class:`ConfigError` raised for a value of the wrong type."""

    def fail(expected: str | None = None) -> ConfigError:
        return ConfigError(f"{where(source, key)}: expected {expected or _type_name(tp)}, got {_describe(value)}")

    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise fail()
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key, source)
            except ConfigError as error:
                errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        raise fail()
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool):
            # YAML 1.1 reads an unquoted no/off/false (yes/on/true) as a bool: `mixed_precision: no`
            # in a recipe, or `--set optimisation.mixed_precision=no`, means the choice spelled so
            spelled = [c for c in _YAML_BOOL_SPELLINGS[value] if c in choices]
            if len(spelled) == 1:
                return spelled[0]
        if isinstance(value, bool) or value not in choices:
            error = fail()
            raise ConfigError(str(error) + did_you_mean(value, choices)) if isinstance(value, str) else error
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # built already (a caller in Python)
            return value
        if not isinstance(value, Mapping):
            raise fail(f"a mapping (section {tp.__name__})")
        return build_section(tp, value, key, source)  # type: ignore[arg-type]
    if origin in (list, collections.abc.Sequence) or tp is list:
        # a list; where the annotation says any sequence, a tuple too (values given in Python)
        if not isinstance(value, list) and not (origin is collections.abc.Sequence and isinstance(value, tuple)):
            raise fail("a list")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [coerce(v, item_tp, f"{key}.{i}", source) for i, v in enumerate(value)]
    if origin in (dict, Mapping, collections.abc.Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise fail("a mapping")
        key_tp, item_tp = typing.get_args(tp) or (str, Any)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where(source, key)}: mapping keys must be strings, got {_describe(k)}")
            out[k] = coerce(v, item_tp, f"{key}.{k}", source)
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise fail()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail()
        return value
    if tp is float:
        if isinstance(value, str) and FLOAT_LITERAL.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads "1e-3" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise fail()
        return value
    raise TypeError(f"config annotation {tp!r} at {key!r} is not supported")  # a bug here, not in the recipe


def check_keys(data: Mapping[str, Any], names: Sequence[str], prefix: str, source: str) -> None:
    """A :class:`ConfigError` for the first key of ``data`` not among ``names`` (the keys allowed
    in section ``prefix``; ``""``: the top level), with a did-you-mean hint."""
    unknown = [k for k in data if k not in names]
    if unknown:
        key = f"'{prefix}.{unknown[0]}'" if prefix else f"'{unknown[0]}'"
        raise ConfigError(f"{source}: unknown key {key}{did_you_mean(str(unknown[0]), names)}; "
                          f"allowed keys{' in ' + repr(prefix) if prefix else ''}: {', '.join(names)}")


def build_section(cls: type, data: Mapping[str, Any], prefix: str, source: str) -> Any:
    """``cls(**data)`` for the dataclass ``cls``, every key of ``data`` checked to be a field
    (:func:`check_keys`) and every value against the field's annotation (:func:`coerce`).
    ``prefix``: the section's key path in the recipe (``""``: the top level)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    check_keys(data, names, prefix, source)
    kwargs = {}
    for name in names:
        if name in data:
            kwargs[name] = coerce(data[name], hints[name], f"{prefix}.{name}" if prefix else name, source)
    return cls(**kwargs)

"""The one validator of recipe sections (``mmviews.schema``): a mapping becomes a dataclass
only when every key is a field and every value has the field's type; otherwise one
:class:`ConfigError` line names the source, the key path and the value, with a did-you-mean
hint for a misspelt key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import pytest

from mmviews.schema import ConfigError, _describe, _type_name, build_section, coerce


@dataclass
class Inner:
    size: int = 1
    rate: float = 0.5


@dataclass
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)
    precision: Literal["no", "bf16"] = "no"
    sizes: list[int] = field(default_factory=list)
    pairs: Sequence[int] = ()
    limit: int | None = None
    either: list[int] | int | None = None
    first_null: None | int = None
    opts: dict[str, int] = field(default_factory=dict)


def test_a_valid_mapping_becomes_the_dataclass():
    built = build_section(Outer, {"inner": {"rate": 2}, "precision": False, "sizes": [1, 2], "pairs": (3,),
                                  "limit": None}, "sec", "r.yaml")
    assert built == Outer("x", Inner(1, 2.0), "no", [1, 2], [3], None)  # a sequence comes back a list
    assert isinstance(built.inner.rate, float) and built.precision == "no"  # YAML's bare `no` is the choice
    assert coerce("3e-4", float, "k", "r.yaml") == 3e-4  # YAML 1.1 leaves exponents without a dot as strings


def test_unknown_keys_name_the_path_and_the_closest_field():
    with pytest.raises(ConfigError, match=r"^r.yaml: unknown key 'sec.inner.szie' \(did you mean 'size'\?\); "
                                          r"allowed keys in 'sec.inner': size, rate$"):
        build_section(Outer, {"inner": {"szie": 2}}, "sec", "r.yaml")
    with pytest.raises(ConfigError, match=r"^r.yaml: unknown key 'nme' \(did you mean 'name'\?\); allowed keys: "):
        build_section(Outer, {"nme": "y"}, "", "r.yaml")


@pytest.mark.parametrize(("data", "message"), [
    ({"inner": {"size": "2"}}, "key 'sec.inner.size': expected int, got str '2'"),
    ({"inner": {"size": True}}, "key 'sec.inner.size': expected int, got bool True"),
    ({"inner": 3}, "key 'sec.inner': expected a mapping (section Inner), got int 3"),
    ({"precision": "fp8"}, "key 'sec.precision': expected one of 'no', 'bf16', got str 'fp8'"),
    ({"sizes": (1,)}, "key 'sec.sizes': expected a list, got tuple (1,)"),  # a list field wants a list
    ({"sizes": [1, 2.5]}, "key 'sec.sizes.1': expected int, got float 2.5"),
    ({"limit": "many"}, "key 'sec.limit': expected int, got str 'many'"),  # the one type besides null
    ({"name": None}, "key 'sec.name': expected str, got NoneType None"),
    ({"inner": {"rate": "fast"}}, "key 'sec.inner.rate': expected float, got str 'fast'"),
    ({"inner": {"rate": True}}, "key 'sec.inner.rate': expected float, got bool True"),
    ({"either": "x"}, "key 'sec.either': expected list or int or null, got str 'x'"),  # each type it could be
    ({"first_null": "x"}, "key 'sec.first_null': expected int, got str 'x'"),
    ({"opts": [1]}, "key 'sec.opts': expected a mapping, got list [1]"),
    ({"opts": {1: 2}}, "key 'sec.opts': mapping keys must be strings, got int 1"),
    ({"opts": {"a": "x"}}, "key 'sec.opts.a': expected int, got str 'x'"),
    ({"precision": "bf61"}, "key 'sec.precision': expected one of 'no', 'bf16', got str 'bf61' (did you mean 'bf16'?)"),
    ({"precision": 16}, "key 'sec.precision': expected one of 'no', 'bf16', got int 16"),
])
def test_a_value_of_the_wrong_type_names_the_key_path_and_the_value(data, message):
    with pytest.raises(ConfigError) as caught:
        build_section(Outer, data, "sec", "r.yaml")
    assert str(caught.value) == f"r.yaml: {message}"


def test_keys_at_the_top_level_have_no_prefix_and_optional_values_come_back():
    with pytest.raises(ConfigError) as caught:
        build_section(Outer, {"name": 3}, "", "r.yaml")
    assert str(caught.value) == "r.yaml: key 'name': expected str, got int 3"
    built = build_section(Outer, {"first_null": 3, "either": [1], "opts": {"a": 1}}, "", "r.yaml")
    assert (built.first_null, built.either, built.opts) == (3, [1], {"a": 1})


def test_long_values_are_cut_in_messages_and_types_are_named():
    assert _describe("a" * 58) == "str '" + "a" * 58 + "'"  # a repr of 60 characters is shown whole
    assert _describe("a" * 59) == "str '" + "a" * 56 + "..."  # one more: cut to 57 and marked
    assert _type_name(type(None)) == "null" and _type_name(list[int] | None) == "list or null"
    assert _type_name("Forward") == "Forward"  # an annotation without a name: as written
    with pytest.raises(TypeError, match=r"^config annotation <class 'complex'> at 'k' is not supported$"):
        coerce(1, complex, "k", "r.yaml")

"""Reading config YAML: PyYAML's safe loader with the numbers and booleans of YAML 1.2, duplicate keys
refused, and errors that name the file.

PyYAML implements YAML 1.1, where `1e-4` (no dot) and `1E5` are strings; YAML 1.2 (and every
config a person writes, `lr: 1e-4`) reads them as floats. YAML 1.1 also reads `yes`, `no`, `on` and
`off` (any case) as booleans; YAML 1.2 has only `true` and `false` (`True`, `TRUE`, ...), and reads the
others as strings, as this loader does: a bool option given `yes` is a config error that says to write
`true` (`tiderl.config.schema`). A key given twice in one mapping
silently keeps the last in PyYAML; here it is an error naming both lines.

Anchors and aliases (`base: &b {...}`, `<<: *b`) work as in any YAML, within a budget: a document
whose aliases would expand it by more than `MAX_ALIAS_EXPANSION` nodes beyond its own (an "alias
bomb": a few lines of nested anchors that stand for millions of values), or whose alias refers to
itself, is refused with an error naming the file and the anchor, before anything is built from it.
The check walks the composed node graph once, each shared node counted once, so it is fast
whatever the expansion would be.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, SequenceNode

# The float of YAML 1.2's core schema that YAML 1.1 lacks: an exponent without a dot, an
# exponent without a sign, a leading dot with an exponent. Checked after 1.1's int and float
# resolvers, so `3` stays an int and `0.5` reads as before.
_FLOAT_1_2 = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")

# How many nodes aliases may add to a document beyond the nodes written in it. A config that shares a
# section or two by anchors adds tens to hundreds; an alias bomb adds millions.
MAX_ALIAS_EXPANSION = 10_000


class AliasBudgetError(ConstructorError):
    """A document's aliases expand it past `MAX_ALIAS_EXPANSION` nodes, or an alias refers to itself."""


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader + YAML 1.2 floats + duplicate keys as errors + a budget on alias expansion."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.anchor_names: dict[int, str] = {}  # id(node) -> its anchor, for messages

    def compose_node(self, parent: Any, index: Any) -> Any:
        anchor = None if self.check_event(AliasEvent) else self.peek_event().anchor
        node = super().compose_node(parent, index)
        if anchor is not None:
            self.anchor_names[id(node)] = anchor
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base`: merged by the base class, its keys overridable by the mapping's own
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports unhashable keys
                if key in seen:
                    raise ConstructorError(
                        None, None, f"key {key!r} is given twice (first on line {seen[key].start_mark.line + 1})",
                        key_node.start_mark)
                seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_1_2, list("-+0123456789."))

# YAML 1.2's booleans (the core schema): only true and false. The call above gave ConfigLoader its own copy of
# the resolvers, so dropping YAML 1.1's bool resolver (yes/no/on/off) here leaves PyYAML's loaders as they are.
BOOL_TAG = "tag:yaml.org,2002:bool"
_BOOL_1_2 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
for _first, _resolvers in ConfigLoader.yaml_implicit_resolvers.items():
    _resolvers[:] = [(tag, regexp) for tag, regexp in _resolvers if tag != BOOL_TAG]
ConfigLoader.add_implicit_resolver(BOOL_TAG, _BOOL_1_2, list("tTfF"))

# The words YAML 1.1 reads as booleans and YAML 1.2 as strings: named in the error of a bool option given one.
YAML_1_1_BOOLEANS = frozenset({"yes", "no", "on", "off", "y", "n"})


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_alias_expansion(root: Node, anchor_names: dict[int, str], budget: int = MAX_ALIAS_EXPANSION) -> None:
    """Raise AliasBudgetError if the document under `root` expands, through its aliases, to more than
    `budget` nodes beyond the ones written in it, or holds an alias inside the node it refers to.
    One pass over the node graph (each shared node is sized once): fast even for a bomb."""
    size: dict[int, int] = {}  # id(node) -> nodes in its full expansion (itself included)
    refs: dict[int, int] = {}  # id(node) -> how many places it appears in
    nodes: dict[int, Node] = {}
    entered: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    refs[id(root)] = 1
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            size[key] = 1 + sum(size[id(c)] for c in _children(node))
            continue
        if key in entered:
            continue
        entered.add(key)
        nodes[key] = node
        stack.append((node, True))
        for child in _children(node):
            ckey = id(child)
            refs[ckey] = refs.get(ckey, 0) + 1
            if ckey in entered and ckey not in size:  # entered, not finished: an ancestor of `node`
                name = anchor_names.get(ckey, "?")
                raise AliasBudgetError(None, None, f"alias *{name} refers to the node it is part of (anchor "
                                       f"&{name}): a config cannot contain itself", child.start_mark)
            if ckey not in entered:
                stack.append((child, False))
    written = len(nodes)
    expanded = size[id(root)]
    if expanded - written <= budget:
        return
    # Name the anchor that adds the most: the one whose copies beyond the first weigh the most.
    worst = max((k for k in nodes if refs.get(k, 0) > 1), key=lambda k: (refs[k] - 1) * size[k])
    name = anchor_names.get(worst, "?")
    raise AliasBudgetError(
        None, None,
        f"aliases expand this document from {written} to {expanded} values, over the limit of "
        f"{budget} added by aliases (anchor &{name}, used {refs[worst]} times, stands for {size[worst]} "
        "values each); write such data out, or share fewer or smaller sections by anchors",
        nodes[worst].start_mark)


def load_yaml(text: str, source: str) -> Any:
    """Parse config YAML; errors (yaml.YAMLError) carry `source` as the file name in their marks.
    Aliases that would expand the document past `MAX_ALIAS_EXPANSION` nodes: AliasBudgetError."""
    loader = ConfigLoader(text)
    loader.name = source  # the reader would call a string "<unicode string>"
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise yaml.YAMLError(f"{source}: nested too deeply to read") from None
        if node is None:
            return None
        check_alias_expansion(node, loader.anchor_names)
        return loader.construct_document(node)
    finally:
        loader.dispose()

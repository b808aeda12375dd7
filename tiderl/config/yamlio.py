"""Reading config YAML: PyYAML's safe loader with the numbers of YAML 1.2, duplicate keys refused,
and errors that name the file.

PyYAML implements YAML 1.1, where `1e-4` (no dot) and `1E5` are strings; YAML 1.2 (and every
config a person writes, `lr: 1e-4`) reads them as floats. A key given twice in one mapping
silently keeps the last in PyYAML; here it is an error naming both lines.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

# The float of YAML 1.2's core schema that YAML 1.1 lacks: an exponent without a dot, an
# exponent without a sign, a leading dot with an exponent. Checked after 1.1's int and float
# resolvers, so `3` stays an int and `0.5` reads as before.
_FLOAT_1_2 = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader + YAML 1.2 floats + duplicate keys as errors."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
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


def load_yaml(text: str, source: str) -> Any:
    """Parse config YAML; errors (yaml.YAMLError) carry `source` as the file name in their marks."""
    loader = ConfigLoader(text)
    loader.name = source  # the reader would call a string "<unicode string>"
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()

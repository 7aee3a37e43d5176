"""Reading the TOML, YAML and JSON files users give (experiment, compare and tune files,
partition lists): one parser for all, strict where the formats are lenient.

- YAML: duplicate keys are refused (the formats' default, last one wins, hides a typo), and
  so are aliases (``*name``): nested aliases expand exponentially ("billion laughs") and a
  configuration has no use for them. JSON refuses duplicate keys too; TOML does by itself.
- Nesting deeper than MAX_DEPTH, which would take the parsers or the code reading the
  result into Python's recursion limit, is refused.
Every failure is a one-line UsageError naming the file.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from fedskew.core.errors import UsageError

MAX_DEPTH = 64  # tables and lists inside each other; a configuration needs a handful
# A configuration is a few kilobytes; parsing a gigabyte of one takes several gigabytes of
# memory before anything could say what is wrong with it.
MAX_CONFIG_BYTES = 16 * 2**20


def read_text_file(path: Path, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of a file a user gives, refused in one line when it is larger than
    ``max_bytes`` (before it is read), missing, unreadable or not text."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise UsageError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if size > max_bytes:
        raise UsageError(
            f"{what} {path} is {size / 2**20:.1f} MiB; at most {max_bytes / 2**20:g} MiB is read"
        )
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"cannot parse {path}: not UTF-8 text") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def parse_structured_text(text: str, suffix: str, where: str) -> Any:
    """The value of a ``.toml``, ``.yaml``/``.yml`` or ``.json`` text."""
    suffix = suffix.lower()
    try:
        if suffix == ".toml":
            value = tomllib.loads(text)
        elif suffix in {".yaml", ".yml"}:
            value = _load_yaml(text)
        elif suffix == ".json":
            value = json.loads(text, object_pairs_hook=_unique_pairs)
        else:
            raise UsageError(f"{where}: expected a .toml, .yaml, .yml or .json file")
    except RecursionError:
        raise UsageError(f"cannot parse {where}: nested too deeply") from None
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise UsageError(f"cannot parse {where}: {_first_line(exc)}") from None
    except UsageError:
        raise
    except Exception as exc:  # yaml.YAMLError, without importing yaml at module load
        if type(exc).__module__.startswith("yaml"):
            raise UsageError(f"cannot parse {where}: {_first_line(exc)}") from None
        raise
    if _depth(value) > MAX_DEPTH:
        raise UsageError(f"cannot parse {where}: nested more than {MAX_DEPTH} levels deep")
    return value


def _first_line(exc: Exception) -> str:
    return " ".join(str(exc).split("\n")[:1]) or type(exc).__name__


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _depth(value: Any) -> int:
    """How deep tables and lists nest in ``value`` (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def _load_yaml(text: str) -> Any:
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.events.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, "aliases (*name) are not accepted", event.start_mark
                )
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass

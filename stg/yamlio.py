"""Reading the YAML files stg is given (model and plan files): safe, bounded, strict.

`yaml.SafeLoader` builds only plain data (no Python objects); on top of it a key given twice
in one mapping is an error rather than the last one silently winning, a file too large to
be a description is refused before parsing, and every way a file can be unreadable (bytes
that are not UTF-8, nesting deep enough to exhaust the parser's stack) is a one-line error.
"""

from __future__ import annotations

from typing import Any

import yaml

from stg.errors import StgError

MAX_BYTES = 16 * 2**20  # the largest zoo file is a few KiB; a description this big is not one


class _StrictLoader(yaml.SafeLoader):
    pass


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key: SafeLoader itself reports it
            break
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (line {key_node.start_mark.line + 1})", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read_yaml(path, what: str, error: type[StgError]) -> Any:
    """The data of the YAML file at `path` (a Path or a package resource); `what` names it in
    errors of type `error`."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise error(f"{what}: cannot read ({err.strerror or err})") from None
    if len(data) > MAX_BYTES:
        raise error(f"{what}: {len(data):,} bytes is too large for a description (at most {MAX_BYTES:,})")
    try:
        return yaml.load(data.decode("utf-8"), Loader=_StrictLoader)
    except UnicodeDecodeError as err:
        raise error(f"{what}: not UTF-8 text (byte {err.start})") from None
    except yaml.YAMLError as err:
        first = str(err).splitlines()
        problem = getattr(err, "problem", None) or (first[0] if first else "unknown error")
        mark = getattr(err, "problem_mark", None)
        at = f", line {mark.line + 1}" if mark is not None else ""
        raise error(f"{what}: not valid YAML ({problem}{at})") from None
    except RecursionError:
        raise error(f"{what}: nested too deeply to be a description") from None

"""Devices and networks as YAML files, each number with its source in the file's comments.

`load("devices", "h100")` reads the packaged stg/data/devices/h100.yaml; a path (anything
ending in .yaml/.yml, or an existing file) reads that file instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from stg.errors import PlanError

DATA = Path(__file__).parent
KINDS = {"devices": "device", "networks": "network"}  # folder -> the field that names one
# libyaml's loader where PyYAML has it: the packaged devices are read at import, and the
# pure-Python one costs several ms of every command's start
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def names(kind: str) -> list[str]:
    return sorted(p.stem for p in (DATA / kind).glob("*.yaml"))


def load(kind: str, name_or_path: str | Path) -> dict[str, Any]:
    """The mapping in a packaged file (by name) or a user's file (by path); PlanError naming
    the field (device, network) when it is unknown, unreadable or not a mapping."""
    field = KINDS[kind]
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith((".yaml", ".yml")) or path.is_file()):
        path = DATA / kind / f"{text}.yaml"
        if not path.is_file():
            raise PlanError(f"{field}: unknown {field} {text!r}; known: {', '.join(names(kind))}, or a YAML file path")
    try:
        data = yaml.load(path.read_text(), Loader=_LOADER)
    except (OSError, yaml.YAMLError) as error:
        raise PlanError(f"{field}: cannot read {path}: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{field}: {path} must hold a mapping, got {type(data).__name__}")
    return data

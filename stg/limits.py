"""One check for every number that reaches a trace: whole, positive, finite, and within the
field it must fit (the Chakra schema's integer types, or a bound that keeps the work finite).

The plan, the model families and the writer all call these, so the CLI, plan files and the
Python API refuse the same values with the same one-line message naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from stg.errors import RangeError, StgError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1

# Bounds on the work itself, far beyond any real run, so that a typo fails at once instead of
# looping for hours: the summary lists every rank (the largest clusters have ~10^5
# accelerators), a rank's program holds every micro-batch and every layer.
MAX_WORLD = 2**22
MAX_MICROBATCHES = 2**16
MAX_LAYERS = 2048  # the deepest published models have ~10^2; 10^3 layers take ~10 s to build
MAX_NODES = 2**22  # per rank: about 1.5 GB of node objects while lowering, minutes of work
MAX_EMBEDDING_RANKS = 2**16  # the table planner's work and report grow with ranks x tables
MAX_TABLES = 100_000  # embedding tables of one model (production DLRMs have ~10^3)

# Chakra field -> (protobuf type, smallest, largest); stg/chakra/et_def.proto
SCHEMA_FIELDS = {
    "id": ("uint64", 0, UINT64_MAX),
    "duration_micros": ("uint64", 0, UINT64_MAX),
    "num_ops": ("int64", 0, INT64_MAX),
    "tensor_size": ("uint64", 0, UINT64_MAX),
    "comm_size": ("int64", 0, INT64_MAX),
    "comm_tag": ("int32", 0, INT32_MAX),
    "comm_src": ("int32", 0, INT32_MAX),
    "comm_dst": ("int32", 0, INT32_MAX),
}


def check_int(field: str, value: Any, error: type[StgError] = RangeError, *, minimum: int = 1,
              maximum: int = INT64_MAX) -> int:
    """`value` if it is an integer in minimum..maximum; else `error` naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{field}: must be {_wanted(minimum)}, got {value!r}")
    if value < minimum:
        raise error(f"{field}: must be {_wanted(minimum)}, got {value}")
    if value > maximum:
        raise error(f"{field}: {value} is too large (at most {maximum:,})")
    return value


def check_number(field: str, value: Any, error: type[StgError] = RangeError, *, minimum: float = 0.0,
                 inclusive: bool = False, maximum: float = 1e15) -> float:
    """`value` if it is a finite real number above `minimum` (or at it, if inclusive) and at
    most `maximum`; else `error` naming `field`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{field}: must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise error(f"{field}: must be a finite number, got {value!r}")
    if value < minimum or (value == minimum and not inclusive):
        wanted = "a positive number" if minimum == 0 and not inclusive else f"{'>=' if inclusive else '>'} {minimum:g}"
        raise error(f"{field}: must be {wanted}, got {value!r}")
    if value > maximum:
        raise error(f"{field}: {value!r} is too large (at most {maximum:g})")
    return value


def check_schema(field: str, value: int, where: str) -> int:
    """`value` if it fits Chakra's field `field`; else RangeError naming node and field."""
    kind, low, high = SCHEMA_FIELDS[field]
    if not low <= value <= high:
        raise RangeError(f"{where}: {field}={value} does not fit the trace schema's {kind} field "
                         f"({low}..{high:,}); reduce the sizes that produce it")
    return value


def _wanted(minimum: int) -> str:
    return "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

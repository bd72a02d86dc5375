"""The fuzz properties of tests/test_fuzz.py with many random (not derandomized) examples.

    python benchmarks/fuzz.py [EXAMPLES]     # default 500 per property; prints cases and time

CI runs the same properties with a few fixed examples; run this after touching input handling.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_fuzz as fuzz  # noqa: E402  (the properties and strategies live with the tests)


def main(examples: int) -> None:
    long = settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    counted = {"cases": 0}

    def counting(function):
        @functools.wraps(function)
        def wrapped(*args, **kwargs):
            counted["cases"] += 1
            function(*args, **kwargs)
        return wrapped

    properties = {
        "model files": long(given(fuzz.model_files())(counting(fuzz.check_model_file))),
        "plan files": long(given(fuzz.PLANS, st.booleans())(counting(fuzz.check_plan_file))),
        "cli values": long(given(fuzz.CLI_VALUES)(counting(fuzz.check_cli_values))),
    }
    for name, prop in properties.items():
        start, before = time.perf_counter(), counted["cases"]
        prop()
        outcomes, fuzz.OUTCOMES = dict(fuzz.OUTCOMES), fuzz.Counter()
        print(f"{name}: {counted['cases'] - before} cases in {time.perf_counter() - start:.1f} s, all passed; "
              f"exit 0 (set validated): {outcomes.get(0, 0)}, exit 2 (one-line error): {outcomes.get(2, 0)}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 500)
